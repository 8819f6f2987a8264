//! Generated bindings for the `rewind:action/action` world.
//!
//! Nothing hand-written lives here. The rest of the crate wraps these items in typed
//! Rust; user code never names them. The module is public only because the code that
//! [`export_action!`](crate::export_action) expands to in the user's crate has to reach
//! it by path.

wit_bindgen::generate!({
    path: "wit",
    world: "action",
    pub_export_macro: true,
    export_macro_name: "export",
    default_bindings_module: "::rewind_guest::bindings",
    // The expansion of `export!` in a user crate refers to the runtime by this path, so
    // user crates need not depend on `wit-bindgen` themselves.
    runtime_path: "::rewind_guest::__private::wit_bindgen::rt",
});
