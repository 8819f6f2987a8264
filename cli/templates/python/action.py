"""``{{name}}``: greets each input by name, counts the key's visits in its memory, and draws
a lucky number with a durable call. The call's result is recorded: when the input runs again
after a crash, the same number comes back and the call is not made twice.

Input payload: ``{"name": "Ada"}``. Output: ``{"greeting", "visits", "lucky"}``.
"""

import rewind


class {{Type}}(rewind.Action):
    def run(self, ctx: rewind.Context, event: rewind.Event) -> None:
        name = event.payload["name"]
        visits = ctx.memory("visits", 0) + 1
        ctx.set_memory("visits", visits)
        roll = ctx.call("dice.roll", {})  # a `random` function in agent.toml
        ctx.info(f"greeting {name} (visit {visits})")
        ctx.output({"greeting": f"Hello, {name}!", "visits": visits, "lucky": roll["u64"] % 100})


WitWorld = rewind.export({{Type}})
