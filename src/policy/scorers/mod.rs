//! Scorers: rate every candidate in `[0, 1]`, higher is better.

mod kv_cache;
mod load;
mod prefix;
mod queue;

pub use kv_cache::KvCacheScorer;
pub use load::LoadScorer;
pub use prefix::PrefixScorer;
pub use queue::QueueScorer;

/// Min-max normalises `values` (lower is better) into scores in `[0, 1]`: the lowest value
/// scores 1, the highest 0; all equal score 1.
pub fn lower_is_better(values: &[f64], out: &mut [f64]) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = max - min;
    for (o, v) in out.iter_mut().zip(values) {
        *o = if span > 0.0 { (max - v) / span } else { 1.0 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation() {
        let mut out = [0.0; 3];
        lower_is_better(&[2.0, 4.0, 6.0], &mut out);
        assert_eq!(out, [1.0, 0.5, 0.0]);
        lower_is_better(&[5.0, 5.0, 5.0], &mut out);
        assert_eq!(out, [1.0, 1.0, 1.0]);
    }
}
