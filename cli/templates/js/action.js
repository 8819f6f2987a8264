// `{{name}}`: greets each input by name, counts the key's visits in its memory, and draws a
// lucky number with a durable call. The call's result is recorded: when the input runs
// again after a crash, the same number comes back and the call is not made twice.
//
// Input payload: `{"name": "Ada"}`. Output: `{"greeting", "visits", "lucky"}`.
import { action } from 'rewind';

export const run = action((ctx, event) => {
  const { name } = event.payload;
  const visits = ctx.memory('visits', 0) + 1;
  ctx.setMemory('visits', visits);
  const roll = ctx.call('dice.roll', {}); // a `random` function in agent.toml
  ctx.info(`greeting ${name} (visit ${visits})`);
  ctx.output({ greeting: `Hello, ${name}!`, visits, lucky: parseInt(roll.hex.slice(0, 8), 16) % 100 });
});
