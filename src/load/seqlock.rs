//! A few words a decision reads for every candidate while one writer at a time replaces them:
//! a sequence lock over atomic words. A reader loads a counter, the words and the counter again,
//! and retries only if a write ran in between; it writes nothing shared, where a mutex or an
//! `arc_swap` borrow costs each of hundreds of candidates a locked read-modify-write.
//!
//! All accesses are atomic (no `unsafe`): the words are `AtomicU64`s loaded and stored relaxed,
//! ordered by the fences around them, so a torn read is detected, never undefined.

use std::sync::atomic::{fence, AtomicU64, Ordering};

/// `N` words behind a sequence lock. The count is 0 until the first write, odd while a write is
/// under way and even otherwise. Writers must be serialised by the caller (a mutex they already
/// hold to change what the words describe).
#[derive(Debug)]
pub struct SeqWords<const N: usize> {
    seq: AtomicU64,
    words: [AtomicU64; N],
}

impl<const N: usize> Default for SeqWords<N> {
    fn default() -> Self {
        Self {
            seq: AtomicU64::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl<const N: usize> SeqWords<N> {
    /// Replaces the words. The caller holds the writers' lock.
    pub fn write(&self, words: [u64; N]) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        // No word's store may be seen before the odd count.
        fence(Ordering::Release);
        for (slot, word) in self.words.iter().zip(words) {
            slot.store(word, Ordering::Relaxed);
        }
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// The words of one write, whole, or None before the first.
    pub fn read(&self) -> Option<[u64; N]> {
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before == 0 {
                return None;
            }
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let words = std::array::from_fn(|i| self.words[i].load(Ordering::Relaxed));
            // The loads above may not be seen after the count's re-read.
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == before {
                return Some(words);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn nothing_before_the_first_write_then_the_last_one() {
        let w = SeqWords::<3>::default();
        assert_eq!(w.read(), None);
        w.write([1, 2, 3]);
        w.write([4, 5, 6]);
        assert_eq!(w.read(), Some([4, 5, 6]));
        // A write of zeros is still a write.
        w.write([0; 3]);
        assert_eq!(w.read(), Some([0; 3]));
    }

    #[test]
    fn a_read_during_writes_is_never_torn() {
        // Every write's words all derive from one number; a read that mixed two writes would
        // see them disagree.
        let w = Arc::new(SeqWords::<4>::default());
        let of = |n: u64| [n, n.wrapping_mul(3), !n, n.rotate_left(17)];
        w.write(of(0));
        const WRITES: u64 = 200_000;
        let writer = {
            let w = w.clone();
            std::thread::spawn(move || {
                for n in 1..=WRITES {
                    w.write(of(n));
                }
            })
        };
        let mut last = 0;
        loop {
            let words = w.read().expect("written");
            let n = words[0];
            assert_eq!(words, of(n), "torn read at {n}");
            assert!(n >= last, "went back from {last} to {n}");
            last = n;
            if n == WRITES {
                break;
            }
        }
        writer.join().unwrap();
    }
}
