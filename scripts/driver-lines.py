#!/usr/bin/env python3
# Lines of the drivers (code only: no blank lines, comments or tests) at a42de2e, before the
# per-key core, and in the working tree: issue #23's measure of the drivers. Run from the
# repository root: python3 scripts/driver-lines.py
import sys,re
def count(text):
    # drop #[cfg(test)] mod tests {...} at the end (tests live at the file end here)
    i=text.find('#[cfg(test)]\nmod tests')
    if i>=0: text=text[:i]
    n=0
    for line in text.splitlines():
        t=line.strip()
        if not t or t.startswith('//'): continue
        n+=1
    return n
import subprocess
def show(rev, path):
    if rev: return subprocess.run(['git','show',f'{rev}:{path}'],capture_output=True,text=True).stdout
    return open(path).read()
old=[('a42de2e','host/src/agent/scheduler.rs'),('a42de2e','host/src/server/runtime.rs'),('a42de2e','host/src/cluster/partition.rs')]
new=[(None,p) for p in ['host/src/keys/mod.rs','host/src/keys/stream.rs','host/src/server/runtime/front.rs','host/src/server/runtime/lifecycle.rs','host/src/server/runtime/mod.rs','host/src/server/runtime/replay.rs','host/src/server/states.rs','host/src/cluster/partition.rs']]
for name,files in [('old',old),('new',new)]:
    tot=0
    for rev,p in files:
        c=count(show(rev,p)); tot+=c; print(name,p,c)
    print(name,'total',tot)
