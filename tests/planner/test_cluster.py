"""Cluster profiles (hardware) apart from run settings (world size, memory limit), issue 10.

Every shipped profile is checked (a glob: a new file in osdp/profiles/ is covered without
editing this test), old-format files load converted with a warning, mixed or broken files
are refused naming the file and the field, and the CLI reads hardware and run apart."""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

import osdp
import osdp.profiler
from osdp.cli import build_parser, main
from osdp.errors import OldClusterFormatWarning, OSDPError
from osdp.models import GPTConfig
from osdp.planner.cluster import (
    DEFAULT_CLUSTER,
    LINK_LEVELS,
    PROFILE_DIR,
    RUN_FIELDS,
    ClusterProfile,
    Link,
    available_clusters,
    load_cluster,
)
from osdp.planner.cost_model import PlannerSettings
from osdp.planner.device import CollectiveCost, DeviceInfo
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings

MiB, GiB = 2**20, 2**30
TINY = GPTConfig(vocab_size=256, seq_len=32, num_layers=3, hidden=64, heads=4)
SHIPPED = sorted(PROFILE_DIR.glob("*.json"))
OLD_TITAN = Path(__file__).parent / "data" / "titan-rtx-pcie3-old-format.json"  # the file as shipped before the split
# the numbers every shipped profile must say the source of (per link level: alpha and beta)
SOURCED = ("flops_per_s", "memory_bandwidth_bytes_per_s", "device_memory_bytes", "node_size")


def _resolves(data: dict, dotted: str) -> bool:
    """Whether "links.intra.alpha_s" names a field of ``data`` (every link's collectives
    hold alpha_s and beta_s_per_byte, so the collective may be left out)."""
    node = data
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict) and {"all_gather", "reduce_scatter"} <= set(node) and part in node["all_gather"]:
            node = node["all_gather"][part]
        else:
            return False
    return True


# ---- every shipped profile -------------------------------------------------------------
def test_profiles_are_found():
    assert len(SHIPPED) >= 3 and [p.stem for p in SHIPPED] == available_clusters()
    assert DEFAULT_CLUSTER in available_clusters()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_profile_is_hardware_with_sources_and_plans(path):
    raw = json.loads(path.read_text())
    assert not set(raw) & set(RUN_FIELDS), f"{path.name} carries a run setting"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shipped files are in the current format
        cluster = load_cluster(path.stem)
    assert load_cluster(str(path)) == cluster
    # fields: the hardware, checked and in range
    assert isinstance(cluster.name, str) and cluster.name
    assert isinstance(cluster.node_size, int) and cluster.node_size >= 1
    assert 2**30 <= cluster.device_memory_bytes <= 2**40
    assert "intra" in cluster.links and set(cluster.links) <= set(LINK_LEVELS)
    for link in cluster.links.values():
        for coll in (link.all_gather, link.reduce_scatter):
            assert 0 < coll.alpha_s < 1e-3 and 0 < coll.beta_s_per_byte < 1e-8  # 1 ms, 100 MB/s: sane bounds
    assert 1e12 <= cluster.flops_per_s <= 1e16 and 1e11 <= cluster.memory_bandwidth_bytes_per_s <= 1e14
    # sources: every headline number has one, and every source names a real field
    assert cluster.sources and all(isinstance(t, str) and len(t) > 10 for t in cluster.sources.values())
    for name in SOURCED + tuple(f"links.{level}.{n}" for level in cluster.links for n in ("alpha_s", "beta_s_per_byte")):
        assert name in cluster.sources, f"{path.name}: no source for {name}"
    for key in cluster.sources:
        assert _resolves(raw, key), f"{path.name}: source {key!r} names no field"
    # round trip
    assert ClusterProfile.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    # a small model plans on it, with the run's numbers (and only those) from the run
    limit = cluster.constant_bytes + GiB
    device = cluster.for_run(RunSettings(world_size=cluster.node_size, memory_limit_bytes=limit))
    assert (device.world_size, device.memory_limit_bytes, device.name) == (cluster.node_size, limit, cluster.name)
    assert (device.all_gather, device.reduce_scatter) == (cluster.links["intra"].all_gather,
                                                          cluster.links["intra"].reduce_scatter)
    plan = make_plan(describe_gpt(TINY), device, PlannerSettings(max_slices=4), batch=4, backend="python")
    assert plan.world_size == cluster.node_size and plan.memory_limit_bytes == limit
    assert plan.device_name == cluster.name and plan.predicted.peak_bytes <= limit


def test_a_run_without_a_memory_limit_may_fill_the_device():
    cluster = load_cluster("a100-nvlink")
    assert cluster.for_run(RunSettings(world_size=4)).memory_limit_bytes == cluster.device_memory_bytes == 80 * GiB


# ---- the default is written once ---------------------------------------------------------
def test_the_default_cluster_is_named_once():
    root = Path(osdp.__file__).parent
    hits = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if DEFAULT_CLUSTER in line]
    assert len(hits) == 1 and hits[0].startswith("planner/cluster.py:"), hits
    parser = build_parser()
    assert parser.parse_args(["plan"]).cluster == DEFAULT_CLUSTER
    assert parser.parse_args(["simulate"]).cluster == DEFAULT_CLUSTER
    assert load_cluster() == load_cluster(DEFAULT_CLUSTER)


# ---- the old format: converted, with a warning; plans as before ---------------------------
@pytest.mark.slow  # the CLI plans with the python search backend: 20-35 s
def test_old_format_file_loads_converted_and_plans_as_before(tmp_path, capsys):
    with pytest.warns(OldClusterFormatWarning, match=re.escape(f"cluster file {OLD_TITAN} is in the old format")) as w:
        old = load_cluster(str(OLD_TITAN))
    text = str(w[0].message)
    assert "world_size 8 -> node_size" in text and "memory_limit_bytes 8.00 GiB -> device_memory_bytes" in text
    assert "load_cluster(path).save(path)" in text
    assert (old.node_size, old.device_memory_bytes) == (8, 8 * GiB)
    new = load_cluster("titan-rtx-pcie3")
    # the old file's implicit run (8 ranks, 8 GiB) on its hardware is the shipped profile at that run
    run = RunSettings(world_size=8, memory_limit_bytes=8 * GiB)
    assert replace(old.for_run(RunSettings(world_size=8)), source="") == replace(new.for_run(run), source="")
    # the CLI with no run flags plans the old file as it did before: 8 ranks at 8 GiB
    with pytest.warns(OldClusterFormatWarning):
        assert main(["plan", "--preset", "tiny", "--cluster", str(OLD_TITAN), "--backend", "python"]) == 0
    assert "world size 8, memory limit 8.00 GiB" in capsys.readouterr().out
    # save writes the current format, which loads without a warning
    path = tmp_path / "converted.json"
    old.save(path)
    assert not set(json.loads(path.read_text())) & {"world_size", "memory_limit_bytes", "all_gather"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_cluster(str(path)) == old


def test_old_format_measured_device_file_keeps_its_fits_and_source(tmp_path):
    device = DeviceInfo(name="2x cpu", world_size=2, memory_limit_bytes=64 * MiB,
                        all_gather=CollectiveCost(1e-5, 1e-9), reduce_scatter=CollectiveCost(2e-5, 2e-9),
                        flops_per_s=1e10, split_efficiency={"2": 1.1}, source="measured by osdp.profile on cpu")
    path = tmp_path / "device.json"
    path.write_text(json.dumps(device.to_dict()))  # what DeviceInfo.save wrote before the split
    with pytest.warns(OldClusterFormatWarning):
        cluster = load_cluster(str(path))
    assert cluster.sources == {"source": "measured by osdp.profile on cpu"}
    # the old file's world size became the node size (one node: no collectives across nodes)
    assert cluster.for_run(RunSettings(world_size=2)) == replace(device, source="source: measured by osdp.profile on cpu",
                                                                 node_size=2)


# ---- broken and mixed files: the file and the field named ---------------------------------
def _profile_file(tmp_path, **changes) -> Path:
    data = json.loads((PROFILE_DIR / "titan-rtx-pcie3.json").read_text())
    data.update(changes)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    return path


INTRA = {"all_gather": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-10},
         "reduce_scatter": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-10}}


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"node_size": 0}, "node_size must be an integer > 0 (devices per node), got 0"),
        ({"node_size": 8.0}, "node_size must be an integer > 0 (devices per node), got 8.0 (a float)"),
        ({"device_memory_bytes": "24GiB"},
         "device_memory_bytes must be a number > 0 (bytes of one device, e.g. 25769803776 for 24 GiB), got '24GiB' (a str)"),
        ({"links": {"inter": INTRA}},
         'links lacks "intra" (the collectives within a node): "links": {"intra": {"all_gather": {"alpha_s": ..., '
         '"beta_s_per_byte": ...}, "reduce_scatter": {...}}}'),
        ({"links": {"intra": INTRA, "rack": INTRA}},
         "links has unknown levels ['rack']; the levels are 'intra' (within a node of node_size devices) and "
         "'inter' (a ring across nodes)"),
        ({"links": [INTRA]}, f"links must be an object, got {[INTRA]!r} (a list)"),
        ({"links": {"intra": {"all_gather": INTRA["all_gather"]}}},
         "links.intra lacks ['reduce_scatter']; it takes ['all_gather', 'reduce_scatter', 'all_reduce']"),
        ({"links": {"intra": dict(INTRA, all_gather={"alpha_s": -1, "beta_s_per_byte": 0})}},
         "links.intra.all_gather.alpha_s must be a number >= 0, got -1"),
        ({"sources": {"flops_per_s": 5}}, "sources maps a field or topic to where its number comes from (text), "
                                          "got 'flops_per_s': 5 (an int)"),
        ({"memory_limit_bytes": 8 * GiB},
         "memory_limit_bytes is a run setting, not hardware (this file has device_memory_bytes, so it is in the current "
         "format): remove memory_limit_bytes and give it to the run (RunSettings(memory_limit_bytes=...), or "
         "--world-size / --memory)"),
        ({"world_size": 8},
         "world_size is a run setting, not hardware (this file has node_size, so it is in the current format): remove "
         "world_size and give it to the run (RunSettings(world_size=...), or --world-size / --memory)"),
        ({"all_gather": INTRA["all_gather"]},
         "all_gather belongs under links.intra in the current format (this file has links): move it there"),
        ({"nodes": 2}, "unknown cluster fields ['nodes']; known: ['constant_bytes', 'device_memory_bytes', "
                       "'flops_per_s', 'links', 'memory_bandwidth_bytes_per_s', 'name', 'node_size', 'op_compute', "
                       "'op_overhead_s', 'slice_overhead_s', 'sources', 'split_efficiency']"),
    ],
)
def test_profile_fields_are_checked(tmp_path, capsys, changes, message):
    path = _profile_file(tmp_path, **changes)
    with pytest.raises(OSDPError) as info:
        load_cluster(str(path))
    assert str(info.value) == f"cluster file {path}: {message}"
    assert main(["plan", "--preset", "tiny", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"osdp: error: cluster file {path}: {message}\n"


def test_missing_fields_are_named(tmp_path):
    data = json.loads((PROFILE_DIR / "h100-nvlink.json").read_text())
    del data["links"], data["device_memory_bytes"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(OSDPError, match=re.escape(f"cluster file {path} lacks ['device_memory_bytes', 'links']")):
        load_cluster(str(path))
    old = json.loads(OLD_TITAN.read_text())
    del old["reduce_scatter"]
    path.write_text(json.dumps(old))
    with pytest.raises(OSDPError, match=re.escape(f"cluster file {path} is in the old format (it has ['world_size', "
                                                  "'memory_limit_bytes', 'all_gather']) but lacks ['reduce_scatter']")):
        load_cluster(str(path))


# ---- the API keeps hardware and run apart ---------------------------------------------------
def test_run_settings_are_checked_and_never_enter_a_profile():
    cluster = load_cluster("titan-rtx-pcie3")
    with pytest.raises(OSDPError, match=r"^world_size must be an integer > 0 \(data-parallel ranks\), got 0$"):
        RunSettings(world_size=0)
    with pytest.raises(OSDPError, match=r"^world_size must be an integer > 0 \(data-parallel ranks\), got True \(a bool\)$"):
        RunSettings(world_size=True)
    with pytest.raises(OSDPError, match=r"^memory_limit_bytes must be a number > 0 .* got '8GiB' \(a str\)$"):
        RunSettings(world_size=8, memory_limit_bytes="8GiB")
    with pytest.raises(OSDPError, match=re.escape("world_size, memory_limit_bytes belong to a run, not to a cluster "
                                                  "profile: give them as cluster.for_run(RunSettings(world_size=..., "
                                                  "memory_limit_bytes=...))")):
        cluster.with_(world_size=4, memory_limit_bytes=GiB)
    with pytest.raises(OSDPError, match=r"^a cluster profile has no fields \['speed'\]"):
        cluster.with_(speed=1)
    with pytest.raises(OSDPError, match=r"^for_run takes RunSettings\(world_size=\.\.\., memory_limit_bytes=\.\.\.\), "
                                        r"got 8 \(an int\)$"):
        cluster.for_run(8)
    assert cluster.with_(constant_bytes=0).constant_bytes == 0 and cluster.constant_bytes > 0


def test_a_two_level_profile_loads_and_the_run_reads_both_levels(tmp_path):
    inter = {"all_gather": {"alpha_s": 3e-5, "beta_s_per_byte": 4e-11},
             "reduce_scatter": {"alpha_s": 3e-5, "beta_s_per_byte": 4e-11}}
    data = json.loads((PROFILE_DIR / "h100-nvlink.json").read_text())
    data["links"]["inter"] = inter
    path = tmp_path / "two-level.json"
    path.write_text(json.dumps(data))
    cluster = load_cluster(str(path))
    assert cluster.links["inter"] == Link(CollectiveCost(3e-5, 4e-11), CollectiveCost(3e-5, 4e-11))
    # DeviceInfo holds both levels: "intra" as all_gather, "inter" beside it with node_size
    # (the cost model prices groups across nodes in two levels: collective_cost.py)
    for world in (8, 16):
        device = cluster.for_run(RunSettings(world_size=world))
        assert device.all_gather == cluster.links["intra"].all_gather
        assert device.inter_all_gather == cluster.links["inter"].all_gather
        assert device.inter_reduce_scatter == cluster.links["inter"].reduce_scatter
        assert device.node_size == 8
    # one level: the same link for any world size (as before the split; bench/planner.py runs 256 ranks)
    flat = load_cluster("h100-nvlink")
    assert flat.for_run(RunSettings(world_size=256)).all_gather == flat.links["intra"].all_gather


# ---- the profiler: a measured profile and the run it was measured under -------------------
def test_profile_measures_hardware_and_returns_the_run_apart(tmp_path):
    from osdp.models import GPT, example_batch

    config = GPTConfig(vocab_size=32, seq_len=8, num_layers=1, hidden=8, heads=2)
    measured = osdp.profiler.profile(GPT(config), example_batch(config, 2), memory_limit="64MiB", cache_dir=tmp_path,
                                    progress=False, repeats=1)
    desc, cluster, run = measured
    assert run == RunSettings(world_size=1, memory_limit_bytes=64 * MiB)
    assert isinstance(cluster, ClusterProfile) and cluster.node_size == 1 and cluster.op_compute
    assert cluster.device_memory_bytes == 64 * MiB  # CPU: no device memory to read, the run's limit stands in
    assert set(cluster.sources) == {"measured", "node_size", "device_memory_bytes"}
    assert measured.device == cluster.for_run(run) and measured.device.world_size == 1
    path = tmp_path / "mine.json"
    cluster.save(path)
    assert not set(json.loads(path.read_text())) & set(RUN_FIELDS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_cluster(str(path)) == cluster


# ---- the CLI: --cluster is hardware, --world-size and --memory the run -----------------------
def test_cli_reads_the_run_apart_from_the_cluster(capsys):
    assert main(["plan", "--preset", "tiny", "--cluster", "h100-nvlink", "--world-size", "4", "--memory", "3GiB",
                 "--backend", "python", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "on 8x H100 80GB, NVLink" in out and "world size 4, memory limit 3.00 GiB" in out
    assert main(["plan", "--preset", "tiny", "--cluster", "h100-nvlink", "--backend", "python", "--batch", "4"]) == 0
    assert "world size 8, memory limit 80.00 GiB" in capsys.readouterr().out  # one node, all of a device
    assert main(["simulate", "--world-size", "0"]) == 2
    assert capsys.readouterr().err == "osdp: error: --world-size must be a positive integer, got 0\n"
