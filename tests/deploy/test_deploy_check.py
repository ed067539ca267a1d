"""`deploy_tools.py check`: an operator's verdict on a run's results.json, with the expected
client set (a count or ids, e.g. after a device left) and the missing devices named."""

from __future__ import annotations

import argparse
import json

import pytest
from deploy_tools import check_results, expected_clients
from deploy_tools import main as deploy_tools_main


def write(tmp_path, **results):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return path


@pytest.mark.parametrize(("text", "ids"), [("3", [0, 1, 2]), ("0,2,3", [0, 2, 3]),
                                           ("3,0", [0, 3]), ("7,", [7])])
def test_expected_clients(text, ids):
    assert expected_clients(text) == ids


@pytest.mark.parametrize("text", ["", "0", "-1", "a", "1,1", "1,-2", "2.5"])
def test_expected_clients_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--clients"):
        expected_clients(text)


def test_a_fleet_after_a_device_left(tmp_path):
    lost = {"round": 1, "client": "node 7 (client 1)", "node_id": 7, "client_id": 1,
            "reason": "no reply within 42 s"}
    path = write(tmp_path, status="ok", test={"accuracy": 0.8}, excluded=[lost],
                 clients=[{"client_id": c} for c in (0, 2, 3)])
    assert check_results(path, [0, 2, 3]) == []
    assert deploy_tools_main(["check", str(path), "--clients", "0,2,3"]) == 0
    problems = check_results(path, 4)
    assert problems[0] == "the run's clients are [0, 2, 3], expected [0, 1, 2, 3] (missing [1])"
    assert problems[1] == "excluded node 7 (client 1) in round 1: no reply within 42 s"
    assert deploy_tools_main(["check", str(path), "--clients", "4"]) == 1


def test_a_failed_run_names_its_error_and_exclusions(tmp_path):
    path = write(tmp_path, status="failed", error="RuntimeError: no valid upload",
                 excluded=[{"round": 1, "client": "node 9", "reason": "client error: boom"}])
    assert check_results(path, 2) == ["the run failed: RuntimeError: no valid upload",
                                      "excluded node 9 in round 1: client error: boom"]
    # no "clients" key in a failed run: no KeyError
    assert deploy_tools_main(["check", str(path), "--clients", "2"]) == 1


@pytest.mark.parametrize("content", ["[]", "{bad", "null"])
def test_a_malformed_results_file_is_a_problem_not_a_crash(tmp_path, content):
    path = tmp_path / "results.json"
    path.write_text(content)
    assert check_results(path, 1)
