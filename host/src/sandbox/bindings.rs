//! Generated bindings for the `rewind:action/action` world. Nothing hand-written lives here.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "rewind:action/action",
    imports: {
        "rewind:action/durable.call": async | trappable,
        default: trappable,
    },
    exports: { default: async },
});
