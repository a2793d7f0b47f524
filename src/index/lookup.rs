//! [`OwnershipIndex::lookup`]: per candidate, its longest run of held blocks from block 0.
//!
//! The candidates still matching are a bitset over endpoint ids ("alive"). Each block narrows
//! it: a block held by one endpoint keeps at most that one, a shared block keeps the alive
//! candidates among its holders, read from its bitset summary when it has one (a few word
//! operations) or holder by holder. The walk stops at the first block that keeps nobody, so
//! its cost is the matched length times the words of alive ids (plus the holders of shared
//! blocks without a summary), not the prompt or the index.
//!
//! Counts are kept by transitions rather than per block and candidate: a candidate's matched
//! blocks are the block at which it left "alive"; its confirmed (offloaded, in CPU memory)
//! blocks are the lengths of the runs during which it was in the block's confirmed (offloaded,
//! CPU) set, added up when it leaves one. A prefix held the same way by every candidate costs no per-candidate
//! work at all until the candidates drop out.

use super::holders::Extend;
use super::{EndpointId, OwnershipIndex, PrefixMatch};

/// Calls `f` with the id of each bit of `word` (word number `w`).
#[inline]
fn each_bit(w: usize, mut word: u64, mut f: impl FnMut(usize)) {
    while word != 0 {
        f(w * 64 + word.trailing_zeros() as usize);
        word &= word - 1;
    }
}

impl OwnershipIndex {
    /// Per candidate (same order), the longest run of blocks it holds from block 0 of `hashes`.
    /// Expired predictions do not count. Stops at the first block no candidate extends.
    pub fn lookup(&self, hashes: &[u64], candidates: &[EndpointId]) -> Vec<PrefixMatch> {
        let mut out = vec![PrefixMatch::default(); candidates.len()];
        if candidates.is_empty() || hashes.is_empty() {
            return out;
        }
        // Endpoint id -> first position in `candidates` (ids are small and dense).
        let max_id = candidates.iter().copied().max().unwrap_or(0) as usize;
        let min_id = candidates.iter().copied().min().unwrap_or(0) as usize;
        let mut position = vec![u32::MAX; max_id + 1];
        for (i, &c) in candidates.iter().enumerate().rev() {
            position[c as usize] = i as u32;
        }
        let words = max_id / 64 + 1;
        let mut alive = vec![0u64; words];
        for &c in candidates {
            alive[c as usize / 64] |= 1 << (c % 64);
        }
        // Candidates in a confirmed (offloaded, CPU) run, and since which block, by position.
        let mut confirmed = vec![0u64; words];
        let mut offloaded = vec![0u64; words];
        let mut cpu = vec![0u64; words];
        let mut confirmed_since = vec![0u32; candidates.len()];
        let mut offloaded_since = vec![0u32; candidates.len()];
        let mut cpu_since = vec![0u32; candidates.len()];
        let (mut next, mut next_confirmed, mut next_offloaded, mut next_cpu) = (
            vec![0u64; words],
            vec![0u64; words],
            vec![0u64; words],
            vec![0u64; words],
        );
        // Words that hold alive candidates.
        let (mut lo, mut hi) = (min_id / 64, max_id / 64);
        let now = self.now_ms();
        let mut block = 0u32;
        for &hash in hashes {
            next[lo..=hi].fill(0);
            next_confirmed[lo..=hi].fill(0);
            next_offloaded[lo..=hi].fill(0);
            next_cpu[lo..=hi].fill(0);
            {
                let shard = self.shard(hash).read();
                let Some(b) = shard.block(hash) else {
                    break;
                };
                b.extend(
                    now,
                    &mut Extend {
                        alive: &alive,
                        lo,
                        hi,
                        next: &mut next,
                        confirmed: &mut next_confirmed,
                        offloaded: &mut next_offloaded,
                        cpu: &mut next_cpu,
                    },
                );
            }
            if next[lo..=hi].iter().all(|&w| w == 0) {
                break;
            }
            let at = |id: usize| position[id] as usize;
            for w in lo..=hi {
                if next[w] == alive[w]
                    && next_confirmed[w] == confirmed[w]
                    && next_offloaded[w] == offloaded[w]
                    && next_cpu[w] == cpu[w]
                {
                    // Everyone here extends, as they were (a shared prefix, block after block).
                    continue;
                }
                // Runs that end here: confirmed (offloaded) from `since` to this block.
                each_bit(w, confirmed[w] & !next_confirmed[w], |id| {
                    out[at(id)].confirmed_blocks += block - confirmed_since[at(id)];
                });
                each_bit(w, next_confirmed[w] & !confirmed[w], |id| {
                    confirmed_since[at(id)] = block;
                });
                each_bit(w, offloaded[w] & !next_offloaded[w], |id| {
                    out[at(id)].offloaded_blocks += block - offloaded_since[at(id)];
                });
                each_bit(w, next_offloaded[w] & !offloaded[w], |id| {
                    offloaded_since[at(id)] = block;
                });
                each_bit(w, cpu[w] & !next_cpu[w], |id| {
                    out[at(id)].cpu_blocks += block - cpu_since[at(id)];
                });
                each_bit(w, next_cpu[w] & !cpu[w], |id| {
                    cpu_since[at(id)] = block;
                });
                // Candidates that stop here matched the blocks before it.
                each_bit(w, alive[w] & !next[w], |id| out[at(id)].blocks = block);
                alive[w] = next[w];
                confirmed[w] = next_confirmed[w];
                offloaded[w] = next_offloaded[w];
                cpu[w] = next_cpu[w];
            }
            while alive[lo] == 0 {
                lo += 1;
            }
            while alive[hi] == 0 {
                hi -= 1;
            }
            block += 1;
        }
        // The candidates still alive matched every block walked; their runs end here too.
        let at = |id: usize| position[id] as usize;
        for w in lo..=hi {
            each_bit(w, confirmed[w], |id| {
                out[at(id)].confirmed_blocks += block - confirmed_since[at(id)];
            });
            each_bit(w, offloaded[w], |id| {
                out[at(id)].offloaded_blocks += block - offloaded_since[at(id)];
            });
            each_bit(w, cpu[w], |id| {
                out[at(id)].cpu_blocks += block - cpu_since[at(id)];
            });
            each_bit(w, alive[w], |id| out[at(id)].blocks = block);
        }
        // Repeated candidates get the result of their first occurrence.
        for i in 0..candidates.len() {
            let p = position[candidates[i] as usize] as usize;
            if p != i {
                out[i] = out[p];
            }
        }
        out
    }
}
