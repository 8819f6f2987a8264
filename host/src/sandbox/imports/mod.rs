//! The host side of the world's imports, one file per WIT interface.

mod context;
mod durable;
mod types;
