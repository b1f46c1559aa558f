"""Tests for sim.reference against the real Pollux/Sia data (read by path, never copied)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest

from sim.reference import (
    DEFAULT_ENV,
    ReferenceDataMissing,
    discover_models,
    load_measurements,
    load_validation,
    load_workload,
    reference_root,
)

SIA_MODELS = {"bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3", "gpt_pmp"}
SIA_TYPES = ["aws", "azure", "dgx", "dgx-ext", "quad", "rtx"]


@pytest.fixture(scope="module")
def root() -> Path:
    try:
        return reference_root()
    except ReferenceDataMissing as exc:  # pragma: no cover - depends on the machine
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def sia(root):
    return discover_models(root / "sia")


@pytest.fixture(scope="module")
def cifar_dir(root) -> Path:
    return root / "sia" / "sia-simulator" / "traces" / "cifar10"


def _rows(m, placement):
    return m.select(np.array(m.placement) == placement)


# ------------------------------------------------------------------ root


def test_default_root_is_next_to_repo(root):
    repo = Path(__file__).resolve().parent.parent
    assert root.resolve() == (repo.parent / "shared" / "reference").resolve()


def test_missing_folder_raises_with_path_and_hint(tmp_path):
    missing = tmp_path / "no-such-reference"
    with pytest.raises(ReferenceDataMissing) as info:
        reference_root(missing)
    assert isinstance(info.value, FileNotFoundError)
    assert str(missing) in str(info.value)
    assert DEFAULT_ENV in str(info.value) and "--reference" in str(info.value)


def test_env_var_is_honoured(monkeypatch, tmp_path, root):
    monkeypatch.setenv(DEFAULT_ENV, str(tmp_path))
    assert reference_root() == tmp_path
    # an explicit path still wins over the environment
    assert reference_root(root) == root
    monkeypatch.setenv(DEFAULT_ENV, str(tmp_path / "gone"))
    with pytest.raises(ReferenceDataMissing, match="gone"):
        reference_root()


def test_folder_without_models_raises(tmp_path):
    (tmp_path / "philly.csv").write_text("timestamp,duration\n1,2\n")
    with pytest.raises(ReferenceDataMissing, match=str(tmp_path)):
        discover_models(tmp_path)


# ------------------------------------------------------------------ discovery


def test_sia_discovery_finds_all_models_and_types(sia):
    assert set(sia) == SIA_MODELS
    for name in SIA_MODELS - {"gpt_pmp"}:
        assert sia[name].gpu_types == SIA_TYPES, name
        assert sorted(sia[name].scalability) == SIA_TYPES, name
    assert sia["gpt_pmp"].gpu_types == ["dgx-ext", "rtx"]
    # the unsuffixed copy was skipped in favour of placements-aws.csv
    assert len(sia["cifar10"].placements["aws"]) == 1183


def test_pollux_unsuffixed_files_are_aws(root):
    pollux = discover_models(root / "pollux")
    assert set(pollux) == SIA_MODELS - {"gpt_pmp"}
    assert all(m.gpu_types == ["aws"] for m in pollux.values())
    assert len(pollux["ncf"].placements["aws"]) == 1661
    assert len(pollux["ncf"].scalability["aws"]) == 458


def _fake_model(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True)
    for name, step in files.items():
        (folder / name).write_text(f"placement,local_bsz,step_time,sync_time\n1,8,{step},0.01\n")
    (folder / "validation-8.csv").write_text("progress,iteration,metric,grad_sqr,grad_var\n1,1,0.5,2,3\n")


def test_unsuffixed_file_skipped_when_aws_exists(tmp_path):
    _fake_model(tmp_path / "m", {"placements.csv": "0.5", "placements-aws.csv": "0.25"})
    _fake_model(tmp_path / "n", {"placements.csv": "0.5", "placements-rtx.csv": "0.25"})
    models = discover_models(tmp_path)
    assert models["m"].gpu_types == ["aws"]
    assert models["m"].placements["aws"].step_time[0] == 0.25
    assert models["n"].gpu_types == ["aws", "rtx"]
    assert models["n"].placements["aws"].step_time[0] == 0.5


def test_duplicate_model_with_equal_types_is_an_error(tmp_path):
    _fake_model(tmp_path / "a" / "m", {"placements-rtx.csv": "0.5"})
    _fake_model(tmp_path / "b" / "m", {"placements-quad.csv": "0.5"})
    with pytest.raises(ValueError, match="found in both"):
        discover_models(tmp_path)


def test_whole_root_prefers_folder_with_more_types(root):
    models = discover_models(root)
    assert set(models) == SIA_MODELS
    assert all("sia" in m.folder.parts for m in models.values())
    assert models["bert"].gpu_types == SIA_TYPES


def test_batch_limits(sia):
    cifar = sia["cifar10"]
    assert (cifar.init_batch, cifar.max_batch) == (128, 4096)
    assert sorted(cifar.validation) == [128, 256, 512, 1024, 2048, 4096]
    assert sia["yolov3"].local_bsz_limits("aws") == (4, 16)
    assert sia["yolov3"].local_bsz_limits("rtx") == (4, 8)
    assert (sia["imagenet"].init_batch, sia["imagenet"].max_batch) == (200, 12800)
    with pytest.raises(KeyError, match="gpt_pmp"):
        sia["gpt_pmp"].local_bsz_limits("aws")


# ------------------------------------------------------------------ measurements


def test_placement_digits_give_nodes_and_gpus(cifar_dir):
    m = load_measurements(cifar_dir / "placements-aws.csv")
    rows = _rows(m, "1313")
    assert len(rows) == 11
    assert set(rows.nodes) == {4} and set(rows.gpus) == {8}
    single = _rows(m, "1")
    assert set(single.nodes) == {1} and set(single.gpus) == {1}
    assert np.all(m.compute_time == m.step_time - m.sync_time)
    assert m.local_bsz.dtype.kind == "i" and m.step_time.dtype.kind == "f"


def test_columns_read_by_name(cifar_dir, tmp_path):
    """rtx puts placement last; aws puts it first. Both must decode to the same fields."""
    aws = _rows(load_measurements(cifar_dir / "placements-aws.csv"), "1")
    rtx = _rows(load_measurements(cifar_dir / "placements-rtx.csv"), "1")
    assert list(aws.local_bsz) == list(rtx.local_bsz) == [32, 45, 64, 91, 129, 182, 257, 363, 513, 725, 1024]
    assert np.all(rtx.step_time > rtx.sync_time) and np.all(aws.step_time > aws.sync_time)
    assert rtx.step_time[0] == pytest.approx(0.043465644121170044)
    assert rtx.sync_time[0] == pytest.approx(0.00038437600061297416)

    # The same rtx file rewritten in aws's column order loads to identical arrays.
    with open(cifar_dir / "placements-rtx.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    reordered = tmp_path / "placements-rtx.csv"
    with open(reordered, "w", newline="") as fh:
        writer = csv.DictWriter(fh, ["placement", "local_bsz", "step_time", "sync_time"])
        writer.writeheader()
        writer.writerows(rows)
    a = load_measurements(cifar_dir / "placements-rtx.csv")
    b = load_measurements(reordered)
    assert a.placement == b.placement
    for field in ("nodes", "gpus", "local_bsz", "step_time", "sync_time"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field


def test_scalability_columns_and_integral_floats(root, cifar_dir):
    rtx = load_measurements(cifar_dir / "scalability-rtx.csv")  # local_bsz first, nodes last
    assert rtx.placement[0] == ""
    assert (rtx.nodes[0], rtx.gpus[0], rtx.local_bsz[0]) == (3, 3, 32)
    # imagenet scalability-dgx writes local_bsz as "20.0"
    dgx = load_measurements(root / "sia" / "sia-simulator" / "traces" / "imagenet" / "scalability-dgx.csv")
    assert dgx.local_bsz.dtype.kind == "i" and dgx.local_bsz.min() == 20


def test_select_and_read_only(cifar_dir):
    m = load_measurements(cifar_dir / "placements-aws.csv")
    two = m.select(m.gpus == 2)
    assert len(two) > 0 and set(two.gpus) == {2}
    assert set(two.placement) <= {"2", "11"}
    with pytest.raises(ValueError):
        m.step_time[0] = 1.0


def test_malformed_csv_names_file(tmp_path):
    bad = tmp_path / "placements-rtx.csv"
    bad.write_text("placement,local_bsz,step_time,sync_time\n1,32,0.1,0.01\n2,abc,0.2,0.02\n")
    with pytest.raises(ValueError, match=r"placements-rtx\.csv.*line 3.*local_bsz"):
        load_measurements(bad)
    missing = tmp_path / "scalability-x.csv"
    missing.write_text("num_nodes,local_bsz,step_time,sync_time\n1,32,0.1,0.01\n")
    with pytest.raises(ValueError, match=r"scalability-x\.csv"):
        load_measurements(missing)
    nolocal = tmp_path / "placements-y.csv"
    nolocal.write_text("placement,step_time,sync_time\n1,0.1,0.01\n")
    with pytest.raises(ValueError, match=r"placements-y\.csv.*local_bsz"):
        load_measurements(nolocal)


def test_discovery_surfaces_bad_file(cifar_dir, tmp_path):
    model = tmp_path / "cifar10"
    model.mkdir()
    shutil.copy(cifar_dir / "validation-128.csv", model)
    (model / "placements-rtx.csv").write_text("placement,local_bsz,step_time,sync_time\n1x,32,0.1,0.01\n")
    with pytest.raises(ValueError, match="placements-rtx.csv"):
        discover_models(tmp_path)


# ------------------------------------------------------------------ validation


def test_validation_run(cifar_dir):
    run = load_validation(cifar_dir / "validation-128.csv")
    assert run.batch_size == 128
    assert len(run) == 100
    assert run.iteration[0] == 390 and run.progress[0] == pytest.approx(391.0)
    assert np.all(np.diff(run.progress) > 0)
    assert np.all(run.grad_sqr > 0) and np.all(run.grad_var > 0)


def test_validation_needs_batch_in_name(cifar_dir, tmp_path):
    odd = tmp_path / "validation.csv"
    shutil.copy(cifar_dir / "validation-128.csv", odd)
    with pytest.raises(ValueError, match="validation.csv"):
        load_validation(odd)


# ------------------------------------------------------------------ workloads


def test_workload_loads_160_jobs_sorted(root):
    jobs = load_workload(root / "pollux" / "workloads" / "workload-6.csv")
    assert len(jobs) == 160
    times = [j.time for j in jobs]
    assert times == sorted(times)
    counts = {}
    for j in jobs:
        counts[j.application] = counts.get(j.application, 0) + 1
    assert counts == {"cifar10": 67, "ncf": 54, "deepspeech2": 16, "bert": 15, "yolov3": 5, "imagenet": 3}
    assert all(j.num_replicas == 1 and j.batch_size == 32768 for j in jobs if j.application == "ncf")


def test_workload_sorts_and_reads_by_name(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text(
        "batch_size,application,extra,name,num_replicas,time\n128,cifar10,x,late,2,50.5\n12,bert,y,early,1,3\n"
    )
    jobs = load_workload(path)
    assert [j.name for j in jobs] == ["early", "late"]
    assert jobs[1].time == 50.5 and jobs[1].batch_size == 128 and jobs[1].num_replicas == 2


def test_workload_bad_row_names_file_and_line(tmp_path):
    path = tmp_path / "workload-bad.csv"
    path.write_text("name,time,application,num_replicas,batch_size\na,1,cifar10,1,128\nb,2,cifar10,two,128\n")
    with pytest.raises(ValueError, match=r"workload-bad\.csv, line 3.*num_replicas"):
        load_workload(path)
