//! Generated bindings for the `rewind:action/action` world, at each version the host runs:
//! 0.2.0 (guest-sdk/wit/action.wit) and 0.1.0 (guest-sdk/wit/0.1.0/action.wit). Nothing hand-written lives here.

wasmtime::component::bindgen!({
    path: "../guest-sdk/wit",
    world: "rewind:action/action",
    imports: {
        "rewind:action/durable": async | trappable,
        default: trappable,
    },
    exports: { default: async },
});

/// The 0.1.0 world: components built before durable waits.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../guest-sdk/wit/0.1.0",
        world: "rewind:action/action",
        imports: {
            "rewind:action/durable.call": async | trappable,
            default: trappable,
        },
        exports: { default: async },
    });
}
