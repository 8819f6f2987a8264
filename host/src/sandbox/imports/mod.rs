//! The host side of the world's imports, one file per WIT interface; `v0_1` is the 0.1.0
//! world's, over them.

mod context;
mod durable;
mod types;
mod v0_1;
