//! Criterion benches live in `benches/`; this library is empty.
