// Builds a JavaScript action into a component: `node build.mjs ACTION.js OUT.wasm WIT_DIR`.
//
// `rewind build` runs it from the directory it installs these tools into. esbuild bundles
// the action with its imports, found from the action's directory as node finds them (the
// SDK, `rewind`, among them: the action's package.json names it); `rewind:action/*` are the
// world's imports and stay imports. Then componentize-js makes the component of world
// `action`. wasi:http is left out (`http`, `fetch-event`): the sandbox has no network.
import { componentize } from '@bytecodealliance/componentize-js';
import { build } from 'esbuild';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

const [source, out, wit] = process.argv.slice(2);
if (!source || !out || !wit) {
  console.error('usage: node build.mjs ACTION.js OUT.wasm WIT_DIR');
  process.exit(2);
}

const work = await mkdtemp(join(tmpdir(), 'rewind-js-'));
try {
  const bundle = join(work, 'action.js');
  await build({
    entryPoints: [source],
    bundle: true,
    format: 'esm',
    platform: 'neutral',
    target: 'es2022',
    outfile: bundle,
    // A package of npm may name its entry by `main` alone; `neutral` reads no field unless told.
    mainFields: ['module', 'main'],
    external: ['rewind:*'],
    logLevel: 'warning',
  });
  const { component } = await componentize({
    sourcePath: bundle,
    witPath: resolve(wit),
    worldName: 'action',
    disableFeatures: ['http', 'fetch-event'],
  });
  await writeFile(out, component);
} finally {
  await rm(work, { recursive: true, force: true });
}
