//! Pickers: order eligible candidates by their combined score.

mod max_score;

pub use max_score::{MaxScore, TieBreak};
