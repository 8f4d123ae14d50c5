"""Schedule validation: every bad input names its culprit; the bundled schedules load."""

from __future__ import annotations

import pytest
import torch
import yaml

from sluice.errors import ScheduleError
from sluice.pipeline.schedule import SCHEDULES_DIR, load_schedule, parse_schedule

BASE = {
    "name": "t",
    "stages": {"route": {}, "predict": {"after": ["route"]}, "fetch": {"prefetch": True}, "h2d": {"stream": "copy"}, "compute": {}, "combine": {}},
}


def with_stage(name, body):
    doc = {"name": "t", "stages": {**BASE["stages"], name: body}}
    return doc


TABLE = {"name": "t", "stages": {n: {"via": "table"} for n in ("route", "fetch", "h2d", "compute")} | {"combine": {}}}


def with_table(name, body):
    """A `via: table` schedule with one stage's knobs set."""
    return {"name": "t", "stages": {**TABLE["stages"], name: {"via": "table", **body}}}


@pytest.mark.parametrize("path", sorted(SCHEDULES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_bundled_schedules_load(path):
    s = load_schedule(path)
    order = [st.name for st in s.stages]
    assert order.index("route") < order.index("fetch") < order.index("h2d") < order.index("compute") < order.index("combine")
    assert load_schedule(path.stem).name == s.name


def test_serial_waits_and_overlap_streams():
    serial, overlap = load_schedule("serial"), load_schedule("overlap")
    assert serial.stage("h2d").after == ("fetch",) and serial.stage("h2d").stream == "compute"
    assert serial.stage("predict") is None
    assert overlap.stage("h2d").stream == "copy" and overlap.stage("h2d").after == ()
    assert overlap.stage("fetch").knobs.prefetch is True


@pytest.mark.parametrize(
    "doc, message",
    [
        ({**BASE, "colour": "red"}, "unknown key 'colour'"),
        (with_stage("fetch", {"prefech": True}), "stage 'fetch': unknown key 'prefech'"),
        (with_stage("fetch", {"prefetch": "yes"}), "'prefetch' must be bool"),
        (with_stage("fetch", {"readers": -2}), "'readers' must be >= 0"),
        (with_stage("h2d", {"stream": "side"}), "'stream' must be one of compute, copy"),
        (with_stage("h2d", {"vram_policy": "mru"}), "stage 'h2d': 'vram_policy' must be one of lru, lfu, got 'mru'"),
        (with_stage("h2d", {"hot_set": 3}), "'hot_set' must be str"),
        (with_stage("h2d", {"cpu_share": 1.5}), "'cpu_share' must be between 0 and 1, got 1.5"),
        (with_stage("h2d", {"cpu_prefill": -2}), "'cpu_prefill' must be -1 \\(where cheaper\\), 0 \\(never\\) or a token count"),
        (with_stage("compute", {"cpu_threads": -1}), "stage 'compute': 'cpu_threads' must be >= 0, got -1"),
        (with_stage("route", {"shared": "never"}), "stage 'route': 'shared' must be early or late, got 'never'"),
        (with_table("route", {"shared": "early"}), "stage 'route': 'shared' must be side or late, got 'early'"),
        (with_table("fetch", {"guess_reads": 0}), "stage 'fetch': 'guess_reads' must be >= 1, got 0"),
        (with_table("fetch", {"read_pieces": 0}), "stage 'fetch': 'read_pieces' must be >= 1, got 0"),
        (with_table("fetch", {"prefetch": True, "readers": 8, "min_recall": 0.5}), "stage 'fetch': unknown key 'min_recall'"),
        (with_table("compute", {"fp4_matvec": "bytes"}), "stage 'compute': 'fp4_matvec' must be one of auto"),
        (with_table("h2d", {"prompt_cpu": -2}),
         "stage 'h2d': 'prompt_cpu' must be -1 \\(from the rates\\), 0 \\(off\\) or a row count, got -2"),
        (with_table("h2d", {"prompt_cpu": 1.5}), "'prompt_cpu' must be int"),
        (with_table("compute", {"cpu_wait": "gpu"}), "stage 'compute': 'cpu_wait' must be device or host, got 'gpu'"),
        (with_table("compute", {"cpu_poll_ns": 200000}), "stage 'compute': 'cpu_poll_ns' must be at most 100000, got 200000"),
        (with_stage("fetch", {"via": "disk"}), "stage 'fetch': 'via' must be one of cache, table, got 'disk'"),
        (with_table("fetch", {"after": ["route"]}), "stage 'fetch': unknown key 'after' \\(allowed: via, vram, "),
        ({"name": "t", "stages": {**TABLE["stages"], "combine": {"stream": "copy"}}},
         "stage 'combine': 'after' and 'stream' mean nothing in a via: table schedule"),
        (with_stage("combine", {"via": "disk"}), "stage 'combine': 'via' must be one of cache, table, got 'disk'"),
        ({"name": "t", "stages": {**TABLE["stages"], "h2d": {}}},
         "every stage of a schedule takes the same variant: route, fetch, compute have via: table"),
        (with_stage("fetch", {"read_pieces": 0}), "stage 'fetch': 'read_pieces' must be >= 1, got 0"),
        (with_stage("fetch", {"guess_reads": 0}), "stage 'fetch': 'guess_reads' must be >= 1, got 0"),
        (with_table("fetch", {"depth": 2}), "stage 'fetch': 'depth' 2 .* needs hold: false and prefetch: true"),
        (with_table("fetch", {"guess_extra": 4}),
         "stage 'fetch': 'guess_extra' 4 guesses past the top-k .* needs hold: false and prefetch: true"),
        (with_table("fetch", {"hold": False, "guess_extra": -1}), "stage 'fetch': 'guess_extra' must be >= 0, got -1"),
        (with_stage("compute", {"after": ["shuffle"]}), "runs after 'shuffle', which is not in the schedule"),
        (with_stage("route", {"after": ["combine"]}), "cycle in the stage graph: route -> combine -> .* -> route"),
        (with_stage("combine", {"after": ["fetch"]}), "streaming stage whose output it does not consume"),
        ({"name": "t", "stages": {**BASE["stages"], "prefetcher": {}}}, "unknown stage 'prefetcher'"),
        ({"name": "t", "stages": {k: v for k, v in BASE["stages"].items() if k != "h2d"}}, "required stage\\(s\\) missing: h2d"),
        ({"name": "t", "stages": []}, "'stages' must be a non-empty mapping"),
        ([1, 2], "a schedule is a mapping"),
    ],
)
def test_bad_schedules_are_named(doc, message):
    with pytest.raises(ScheduleError, match=message):
        parse_schedule(doc, "test.yaml")


def test_bad_files(tmp_path):
    with pytest.raises(ScheduleError, match="no schedule named 'fastest'"):
        load_schedule("fastest")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: {route: [}")
    with pytest.raises(ScheduleError, match="bad.yaml: not valid YAML"):
        load_schedule(bad)
    good = tmp_path / "mine.yaml"
    good.write_text(yaml.safe_dump(BASE))
    assert load_schedule(good).name == "t"


def test_knob_edits_after_a_schedule_name(tmp_path):
    """`NAME:STAGE.KNOB=VALUE[:...]` edits a bundled or a file's schedule before validation (values as YAML reads
    them), and the edits join its name; a bad edit is an error naming it, as a bad knob in the file would be."""
    s = load_schedule("direct-stream:fetch.depth=2:fetch.guess_reads=3")
    knobs = s.stage("fetch").knobs
    assert (knobs.depth, knobs.guess_reads, knobs.hold) == (2, 3, False)
    assert s.name == "direct-stream:fetch.depth=2:fetch.guess_reads=3"
    assert load_schedule("overlap:fetch.prefetch=false").stage("fetch").knobs.prefetch is False
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert load_schedule(f"{path}:predict.width=4").stage("predict").knobs.width == 4
    assert load_schedule("direct-stream").stage("fetch").knobs.depth == 1  # the file itself is not changed
    for ref, message in [
        ("direct-stream:fetch.depth", "edit 'fetch.depth': write STAGE.KNOB=VALUE"),
        ("direct-stream:depth=2", "edit 'depth=2': write STAGE.KNOB=VALUE"),
        ("overlap:direct.depth=2", "edit 'direct.depth=2': .*overlap.yaml has no stage 'direct' \\(its stages: route, "),
        ("direct-stream:fetch.dpeth=2", "stage 'fetch': unknown key 'dpeth'"),
        ("direct-stream:fetch.depth=0", "stage 'fetch': 'depth' must be >= 1, got 0"),
        ("direct-stream:fetch.depth=[1", "edit 'fetch.depth=\\[1': the value is not valid YAML"),
        ("fastest:fetch.depth=2", "no schedule named 'fastest'"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            load_schedule(ref)


def test_fp4_matvec_auto_takes_f16x2_only_where_it_measured_faster():
    from sluice.stages.compute import fp4_formulation

    cpu = torch.device("cpu")
    assert fp4_formulation("auto", "relu2", cpu) == "words" and fp4_formulation("f16x2", "swiglu", cpu) == "f16x2"
    if torch.cuda.is_available():
        new = torch.cuda.get_device_capability() >= (8, 9)  # the e4m3 conversion
        assert fp4_formulation("auto", "relu2", torch.device("cuda")) == ("f16x2" if new else "words")
        assert fp4_formulation("auto", "swiglu", torch.device("cuda")) == "words"
        assert fp4_formulation("auto", "swiglu", torch.device("cuda"), fp8=True) == ("f16x2" if new else "words")
    assert fp4_formulation("auto", "swiglu", cpu, fp8=True) == "words"


def test_knob_values_as_written():
    """Whole numbers where a fraction is expected, and -1 where a knob gives it a meaning, are read as meant."""
    h2d = parse_schedule(with_stage("h2d", {"cpu_share": 1, "cpu_prefill": -1}), "test.yaml").stage("h2d").knobs
    assert h2d.cpu_share == 1.0 and isinstance(h2d.cpu_share, float) and h2d.cpu_prefill == -1


def test_stream_contexts_switch_only_when_needed(monkeypatch):
    """`Streams.use` enters torch.cuda.stream only where the named stream is not current already (a one-token step
    would otherwise pay its host cost several times a layer), and restores what was current after."""
    from sluice.pipeline.streams import Streams

    entered = []

    class Ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            entered.append(self.s)

        def __exit__(self, *exc):
            entered.append(f"/{self.s}")

    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    streams = Streams(torch.device("cpu"))
    streams._streams = {"compute": "C", "copy": "Y"}  # as on a GPU
    streams._check = False  # the stand-in streams are not torch's
    with streams.use("compute"):  # current from the start: nothing entered
        with streams.use("copy"):
            with streams.use("copy"):
                with streams.use("compute"):
                    pass
            with streams.use("copy"):
                pass
        with streams.use("compute"):
            pass
    assert entered == ["Y", "C", "/C", "/Y"]
    with pytest.raises(RuntimeError):  # an error inside still restores what was current
        with streams.use("copy"):
            raise RuntimeError("inside")
    entered.clear()
    with streams.use("copy"):
        pass
    assert entered == ["Y", "/Y"]


def test_stream_check_catches_a_raw_stream_around_use(monkeypatch):
    """SLUICE_CHECK_STREAMS=1: a switch `Streams.use` skips, while another stream is in fact current, is an error."""
    from sluice.pipeline.streams import Streams

    streams = Streams(torch.device("cpu"))
    streams._streams = {"compute": "C", "copy": "Y"}  # as on a GPU
    streams._check = True
    current = ["C"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    with streams.use("compute"):  # the real current stream is compute: fine
        pass
    current[0] = "side"  # as inside a raw torch.cuda.stream(side) block
    with pytest.raises(RuntimeError, match="another stream is current"):
        streams.use("compute")


def test_host_buffers_are_kept_per_key():
    """`Streams.host_buffer`: the same tensor for a key until its shape or dtype changes; other keys get their own."""
    from sluice.pipeline.streams import Streams

    streams = Streams(torch.device("cpu"))
    a = streams.host_buffer(("route", 3), torch.Size([1, 4]), torch.int64)
    assert streams.host_buffer(("route", 3), torch.Size([1, 4]), torch.int64) is a
    assert streams.host_buffer(("route", 5), torch.Size([1, 4]), torch.int64) is not a
    b = streams.host_buffer(("route", 3), torch.Size([1, 6]), torch.int64)
    assert b is not a and b.shape == (1, 6)
    assert streams.host_buffer(("route", 3), torch.Size([1, 6]), torch.float32).dtype == torch.float32
