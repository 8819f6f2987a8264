//! `rewind:action/types`: only types, nothing to implement.

use crate::sandbox::bindings::rewind::action::types::Host;
use crate::sandbox::run::RunState;

impl Host for RunState {}
