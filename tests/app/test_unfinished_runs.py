"""A run whose ServerApp is killed (no ``finally`` runs) still leaves a results.json: the
server writes it as "running" before any work, and the launcher turns a "running" file into
a failed run naming the exit code and the uploads saved for a replay."""

from __future__ import annotations

import json
import os

import pytest

from fedfusion import server_app
from fedfusion.app.config import Settings
from fedfusion.app.launch import close_unfinished


def test_results_json_says_running_before_any_work(tmp_path, monkeypatch) -> None:
    seen = {}

    def killed(settings, grid, uploads, folder, results, failures=()):
        seen.update(json.loads((folder / "results.json").read_text()))
        raise MemoryError("stand-in for a process killed mid-run")

    monkeypatch.setattr(server_app, "_run", killed)
    settings = Settings(output_dir=str(tmp_path), run_name="r1", strategy="fedavg")
    with pytest.raises(MemoryError):
        server_app.run_server(settings)
    assert seen["status"] == "running" and seen["settings"]["strategy"] == "fedavg"
    final = json.loads((tmp_path / "r1" / "results.json").read_text())
    assert final["status"] == "failed" and "MemoryError" in final["error"]


def test_the_launcher_closes_a_run_left_running(tmp_path) -> None:
    run = tmp_path / "r1"
    (run / "uploads").mkdir(parents=True)
    for client in (0, 3):
        (run / "uploads" / f"client_{client}.npz").write_bytes(b"")
    (run / "results.json").write_text(json.dumps({"status": "running", "settings": {}}))
    results = close_unfinished(run / "results.json", -9)
    assert results["status"] == "failed"
    assert "exit code -9" in results["error"] and "2 upload(s) saved" in results["error"]
    assert results["uploads_saved"] == ["client_0.npz", "client_3.npz"]
    assert json.loads((run / "results.json").read_text()) == results
    # finished runs are returned as they are
    (run / "results.json").write_text(json.dumps({"status": "ok"}))
    assert close_unfinished(run / "results.json", 0) == {"status": "ok"}


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]"])
def test_an_unreadable_results_file_is_a_clear_error(tmp_path, content) -> None:
    (tmp_path / "results.json").write_text(content)
    with pytest.raises(RuntimeError, match="results.json"):
        close_unfinished(tmp_path / "results.json", 1)


def test_a_symlink_in_place_of_results_json_is_not_written_through(tmp_path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"status": "running"}))
    os.symlink(target, tmp_path / "results.json")
    with pytest.raises(OSError):
        close_unfinished(tmp_path / "results.json", 1)
    assert json.loads(target.read_text()) == {"status": "running"}
