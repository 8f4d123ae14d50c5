"""The GPU's wait for a flag the host writes (kernels/host_wait.py), and a whole step's host turns around it
(pipeline/whole.py): a wait that ends when the host's number lands and not before, one that gives up where it never
does, and a failed turn that raises the flags of the turns left so that no graph waits for good."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sluice.kernels.host_wait import wait_for_host, wait_for_host_ref
from common import DEVICE


def test_the_wait_ends_at_the_hosts_number_and_gives_up_without_it():
    """Interpreted on a CPU: a flag at the wanted number ends the wait at once; one short of it runs the loads out and
    says so (the must-fail: a kernel that returned without waiting would leave gave_up 0), and a later wait that ends in
    time leaves it said."""
    dev = torch.device(DEVICE)
    flag = torch.tensor([3]).pin_memory() if dev.type == "cuda" else torch.tensor([3])
    want, gave_up = torch.tensor([3], device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    wait_for_host(flag, want, gave_up, limit=50)
    assert int(gave_up[0]) == 0 and wait_for_host_ref(flag, want.cpu())
    want.fill_(4)
    wait_for_host(flag, want, gave_up, limit=50)
    assert int(gave_up[0]) == 1 and not wait_for_host_ref(flag, want.cpu())
    want.fill_(3)
    wait_for_host(flag, want, gave_up, limit=50)
    assert int(gave_up[0]) == 1
    gave_up.zero_()  # with a pause between loads (a sleep on CUDA): the same ends
    wait_for_host(flag, want, gave_up, limit=50, pause_ns=500)
    assert int(gave_up[0]) == 0
    want.fill_(4)
    wait_for_host(flag, want, gave_up, limit=50, pause_ns=500)
    assert int(gave_up[0]) == 1


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="a host thread and a GPU stream at once: CUDA")
@pytest.mark.parametrize("pause_ns", [0, 2000])  # reads back to back, and with the warp's sleep between them
def test_what_the_host_wrote_before_the_flag_is_what_the_gpu_copies_after_the_wait(pause_ns):
    flag, rows = torch.zeros(1, dtype=torch.int64).pin_memory(), torch.zeros(4096).pin_memory()
    want, gave_up = torch.ones(1, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    wait_for_host(flag, want, gave_up, pause_ns=pause_ns)
    got = rows.to(DEVICE, non_blocking=True)  # queued after the wait: must see the rows the host wrote

    def host():
        time.sleep(0.2)
        rows.fill_(7.0)
        flag.numpy()[0] = 1
    writer = threading.Thread(target=host)
    writer.start()
    torch.cuda.synchronize()
    writer.join()
    assert int(gave_up[0]) == 0 and bool((got == 7.0).all())


def test_a_wait_that_gave_up_stops_the_next_token():
    """The GPU's give-up (a flag the host never raised) is seen at the next token's start, as an error naming it, not
    left to silently wrong tokens; the must-fail side: with nothing given up the token starts."""
    from sluice.errors import SluiceError
    from sluice.stages.table_cpu import CpuSteps

    seen = torch.zeros(1, dtype=torch.int32)
    counts = torch.zeros(2, 3, dtype=torch.int64)
    t = CpuSteps.__new__(CpuSteps)
    t.__dict__.update(_cpu_bufs={0: None}, _cpu_gave_up=(torch.zeros(1, dtype=torch.int32), seen), _cpu_seq=4,
                      _cpu_dev=(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), None),
                      rt=SimpleNamespace(store=SimpleNamespace(manifest=SimpleNamespace(top_k=2)),
                                         streams=SimpleNamespace(host_buffer=lambda key, shape, dtype: counts)),
                      layers=[0, 1], cpu_counts=lambda K: [[0, 1, 1]] * 2)
    t.cpu_token_begins()
    assert t._cpu_seq == 5
    seen[0] = 1
    with pytest.raises(SluiceError, match="stopped waiting for the CPU's rows"):
        t.cpu_token_begins()


def test_a_failed_turn_raises_the_flags_of_the_turns_left():
    """A graph whose MoE layers wait on the device for the host's turns: the turn that fails and those after it have
    their flags raised (else the replayed graph would wait for them for good), the turns before it not again."""
    from sluice.pipeline.whole import WholeStep, _Whole
    from sluice.stages.table_cpu import CpuTurn

    log = []

    def turn(n: int, fails: bool = False) -> CpuTurn:
        def host():
            log.append(f"host {n}")
            if fails:
                raise RuntimeError("the CPU's rows failed")
        return CpuTurn(host, lambda: None, lambda: log.append(f"release {n}"), True)

    plan = SimpleNamespace(begin_token=lambda: None, token_queued=lambda: None, replayed=lambda ran, marks: None)
    step = WholeStep.__new__(WholeStep)
    step.coordinator, step.replays = SimpleNamespace(plan=plan), 0
    both = torch.zeros(2, dtype=torch.int64)
    w = _Whole(both[:1].view(1, 1), both[1:].view(()), both)
    w.graphs, w.turns = [SimpleNamespace(replay=lambda: log.append("replay"))], [[turn(0), turn(1, fails=True), turn(2)]]
    with pytest.raises(RuntimeError, match="the CPU's rows failed"):
        step._replay(w, None, None)
    assert log == ["replay", "host 0", "host 1", "release 1", "release 2"]


@pytest.mark.parametrize("in_graph", [True, False])
def test_turns_the_gpu_waits_for_stay_in_one_graph(in_graph, monkeypatch):
    """The capture's segments (pipeline/whole.py): turns the GPU waits for on the device (cpu_wait: device) leave the
    step one graph, followed by all its turns in layer order; turns that end a segment (host) make a graph each, the
    last one's graph turnless. Graphs faked: the grouping alone, on a CPU."""
    import contextlib

    from sluice.pipeline.whole import WholeStep
    from sluice.stages.table_cpu import CpuTurn

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    turns = [CpuTurn(lambda: None, lambda: None, lambda: None, in_graph) for _ in range(3)]

    def make(w, state):
        for t in turns:
            yield t

    step = WholeStep.__new__(WholeStep)
    step.graphs, step.pool, step.captures = True, None, 0
    step.model = SimpleNamespace(device=torch.device("cpu"))
    step.rt = SimpleNamespace(streams=SimpleNamespace(capture=lambda graph, pool: contextlib.nullcontext()))
    w = step._capture(make, None, (1, 1), ())
    assert w.turns == ([turns] if in_graph else [[t] for t in turns] + [[]])
    assert len(w.graphs) == len(w.turns)
