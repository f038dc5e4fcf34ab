"""Interrupts: held back while a module imports, and a handled one still exits 130."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from refspec.eval.interrupts import import_holding_interrupts


@contextlib.contextmanager
def _sigint(handler):
    """SIGINT handled by ``handler`` inside the block (a background job inherits it ignored)."""
    before = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_the_import_waits_until_the_module_is_complete(tmp_path, monkeypatch, sig):
    (tmp_path / "slow_mod.py").write_text(
        "import os, signal\n"
        f"os.kill(os.getpid(), {int(sig)})\n"
        "for _ in range(10000):\n    pass\n"  # bytecode after the signal: where Python would raise
        "complete = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_mod", raising=False)
    with _sigint(signal.default_int_handler):
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            import_holding_interrupts("slow_mod")
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert sys.modules["slow_mod"].complete, "the module ran to its end"


def test_an_ignored_signal_stays_ignored_during_the_import(tmp_path, monkeypatch):
    (tmp_path / "ignored_mod.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\ncomplete = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ignored_mod", raising=False)
    with _sigint(signal.SIG_IGN):  # as in a background job
        import_holding_interrupts("ignored_mod")  # no KeyboardInterrupt
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert sys.modules["ignored_mod"].complete


def test_no_interrupt_no_exception_and_an_imported_module_is_left_alone(tmp_path, monkeypatch):
    (tmp_path / "quiet_mod.py").write_text("complete = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "quiet_mod", raising=False)
    import_holding_interrupts("quiet_mod")
    assert sys.modules["quiet_mod"].complete
    import_holding_interrupts("quiet_mod")  # already imported: nothing to hold


def test_an_interrupt_caught_inside_exec_of_a_string_still_exits_130(tmp_path):
    # CPython 3.11 flags a KeyboardInterrupt that ends exec'd code and, run with -m, kills itself
    # with SIGINT at exit although it was caught (without the call below this exits -2)
    (tmp_path / "handled.py").write_text(
        "import sys\nfrom refspec.eval.interrupts import forget_handled_interrupt\n"
        "try:\n    exec('raise KeyboardInterrupt')\nexcept KeyboardInterrupt:\n    pass\n"
        "forget_handled_interrupt()\nsys.exit(130)\n")
    proc = subprocess.run([sys.executable, "-m", "handled"], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 130


class _InterruptedSetName:
    """A class attribute whose ``__set_name__`` is interrupted, as a dataclass field's is when a
    signal lands while its module imports (CPython 3.11 wraps that in a RuntimeError)."""

    def __set_name__(self, owner, name):
        raise KeyboardInterrupt


def test_an_interrupt_wrapped_on_its_way_up_leaves_as_an_interrupt():
    from refspec.eval.interrupts import unwrapped_interrupts

    with pytest.raises(KeyboardInterrupt):
        with unwrapped_interrupts():
            class _Owner:  # noqa: F841
                field = _InterruptedSetName()
    for wrapped in (RuntimeError("cleanup failed"), ValueError("x")):
        with pytest.raises(KeyboardInterrupt) as got:
            with unwrapped_interrupts():
                try:
                    raise KeyboardInterrupt
                except KeyboardInterrupt as exc:
                    raise wrapped from exc
        assert got.value.__cause__ is wrapped
    with pytest.raises(RuntimeError, match="plain"):
        with unwrapped_interrupts():
            raise RuntimeError("plain")


def _wrapped_interrupt(message: str):
    """A callable that raises a RuntimeError wrapping a KeyboardInterrupt, as an import can."""
    def raise_it(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise RuntimeError(message) from exc
    return raise_it


def test_the_cli_exits_130_for_an_interrupt_wrapped_in_an_error(monkeypatch, tmp_path, capsys):
    from refspec.eval import cli

    monkeypatch.setattr(cli, "_execute", _wrapped_interrupt("Error calling __set_name__"))
    assert cli.main(["--out", str(tmp_path / "out")]) == cli.EXIT_INTERRUPTED
    assert "error:" not in capsys.readouterr().err


def test_the_paper_command_does_not_log_a_wrapped_interrupt_as_a_failed_block(tmp_path, monkeypatch, capsys):
    """Its blocks keep going after an error; a Ctrl-C that an import wrapped is not one."""
    from refspec.eval.paper import cli, run

    monkeypatch.setattr(run, "load_target", _wrapped_interrupt("an import wrapped it"))
    assert cli.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "out")]) == 130
    assert "building" not in capsys.readouterr().err
