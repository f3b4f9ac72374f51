"""tests/warm.py: a command forked warm starts its own forkserver processes (a sweep's cells) from the same
pre-imported server, not from a second one that would import torch and transformers again."""

from __future__ import annotations

import os
import textwrap

import warm
from conftest import ROOT

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import os


    def child(q):
        q.put((os.getppid(), os.getcwd()))


    if __name__ == "__main__":
        ctx = mp.get_context("forkserver")
        q = ctx.SimpleQueue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        p.join()
        parent, cwd = q.get()
        print(os.getppid(), parent, cwd, p.exitcode)
""")


def test_a_warm_commands_forkserver_children_come_from_the_warm_server(tmp_path):
    script = tmp_path / "spawns.py"
    script.write_text(SCRIPT)
    work = tmp_path / "cwd"
    work.mkdir()
    done = warm.run([str(script)], work, dict(os.environ, PYTHONPATH=str(ROOT)), tmp_path / "procs", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    server, parent, cwd, code = done.stdout.split()
    assert parent == server and code == "0"  # the command's child was forked by the server that forked the command
    assert cwd == str(work)  # in the command's folder
