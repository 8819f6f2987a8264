// Builds a JavaScript action into a component: `node build.mjs ACTION.js OUT.wasm WIT_DIR`.
//
// esbuild bundles the action with its imports (`rewind` is this SDK; `rewind:action/*` are
// the world's imports and stay imports), then componentize-js makes the component of world
// `action`. wasi:http is left out (`http`, `fetch-event`): the sandbox has no network.
import { componentize } from '@bytecodealliance/componentize-js';
import { build } from 'esbuild';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const [source, out, wit] = process.argv.slice(2);
if (!source || !out || !wit) {
  console.error('usage: node build.mjs ACTION.js OUT.wasm WIT_DIR');
  process.exit(2);
}

const sdk = resolve(dirname(fileURLToPath(import.meta.url)), 'rewind.js');
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
    alias: { rewind: sdk },
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
