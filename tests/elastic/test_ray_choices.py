"""Ray Train's edges that need no Ray cluster: the ``[ray]`` extra missing, and which checkpoint a run that Ray
restarted resumes from (the newest complete one, Ray's or base_path's)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from flair_fabric.launch import ray_train
from flair_fabric.shell.command import main
from flair_fabric.state.training_state import complete_checkpoints

from . import ray_jobs


def test_engine_ray_without_the_ray_extra_is_refused_before_anything_starts_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"trainer: {{base_path: {tmp_path / 'out'}}}\nengine: ray\nray: {{num_workers: 2}}\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # as where the [ray] extra is not installed
    try:
        code = main([str(config)])
    except ImportError as error:
        pytest.fail(f"the command raised instead of refusing the config: {error!r}")
    assert code == 2
    told = capsys.readouterr().err
    assert "engine: ray needs Ray Train" in told and 'pip install "flair-fabric[ray]"' in told, told
    assert not (tmp_path / "out").exists()


def test_a_restarted_run_resumes_from_the_newest_complete_checkpoint_rays_or_base_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray commits a reported checkpoint only when it has every worker's report: a worker lost just after a save
    leaves Ray's newest one older than base_path's, or none yet, and the run resumes from base_path's ('auto') where
    the same Ray run wrote it. Where base_path has none or an older one (another machine, no shared disk), from
    Ray's."""
    ray_jobs.fine_tune(tmp_path / "run", devices=1, keep_checkpoints=3)  # after steps 2, 4 and 6
    steps = complete_checkpoints(tmp_path / "run")
    assert [each.name[-1] for each in steps] == ["2", "4", "6"]
    rays = {name: shutil.copytree(each, tmp_path / "ray" / name) for name, each in zip("246", steps, strict=True)}

    def holding(folder: Path | None) -> None:
        monkeypatch.setattr(ray_train, "ray_checkpoint_folder", lambda: folder)

    holding(rays["4"])
    assert ray_train.resume_under_ray(None, tmp_path / "run") == "auto"
    assert ray_train.resume_under_ray("auto", tmp_path / "run") == "auto"
    assert ray_train.resume_under_ray(None, tmp_path / "elsewhere") == rays["4"]
    shutil.rmtree(steps[2])  # base_path's newest is now step 4, as Ray's: either is the newest
    shutil.rmtree(steps[1])
    assert ray_train.resume_under_ray(None, tmp_path / "run") == rays["4"]
    assert ray_train.resume_under_ray(steps[0], tmp_path / "run") == steps[0], "a folder given is kept"
    holding(None)
    assert ray_train.resume_under_ray(None, tmp_path / "run") is None, "outside Ray, or Ray holds none"
    record = steps[0] / "progress.json"  # base_path's newest now: as if a Ray run had written it
    record.write_text(json.dumps({**json.loads(record.read_text()), "ray_run": "local:///ray/run"}))
    monkeypatch.setattr(ray_train, "ray_run", lambda: "local:///ray/run")
    assert ray_train.resume_under_ray(None, tmp_path / "run") == "auto", "Ray restarted the run before it committed"
    monkeypatch.setattr(ray_train, "ray_run", lambda: "local:///ray/another")
    assert ray_train.resume_under_ray(None, tmp_path / "run") is None, "another Ray run starts afresh, as asked"
