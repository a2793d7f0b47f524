//! Filters: exclude candidates that must not be picked while another is available.

mod saturation;

pub use saturation::Saturation;
