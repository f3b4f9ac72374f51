"""One error shape for a hub id that cannot be had (harness/models/hub.py `require`), for corpora and models alike."""

from __future__ import annotations

import importlib.util

import pytest

from harness.analysis import corpus
from harness.errors import QuantbenchError
from harness.models import HFModel, hub


@pytest.fixture()
def answer(monkeypatch, tmp_path):
    """Set what the hub answers; nothing is cached locally."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    said = {"value": "ok"}
    monkeypatch.setattr(hub, "probe", lambda repo_id, repo_type="model", revision=None: said["value"])
    monkeypatch.setattr(hub, "cached_snapshot", lambda *a, **k: None)
    real = importlib.util.find_spec  # the corpus check asks whether `datasets` (an optional extra) is installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "datasets" else real(name, *a))
    return said


def _error(fn) -> str:
    with pytest.raises(QuantbenchError) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text
    return text


def test_missing_and_unreachable_read_the_same_for_a_corpus_and_a_model(answer):
    def dataset():
        return corpus.check("owner/corpus:raw:test")

    def model():
        return HFModel(name_or_path="owner/model").preflight()

    answer["value"] = "missing"
    d, m = _error(dataset), _error(model)
    assert d.startswith("accuracy.corpus='owner/corpus:raw:test': the hub has no dataset 'owner/corpus', or it is gated")
    assert m.startswith("model.name_or_path='owner/model': the hub has no model 'owner/model' (revision 'main'), or it "
                        "is gated")
    assert "local text file" in d and "local directory" in m

    answer["value"] = "unreachable: ConnectError"
    d, m = _error(dataset), _error(model)
    assert "is not in the local HF datasets cache (" in d and "is not in the local HF cache (" in m
    for text in (d, m):
        assert "the hub is unreachable (ConnectError)" in text and text.endswith(
            ", or fetch it once where the hub is reachable")

    answer["value"] = "ok"
    corpus.check("owner/corpus:raw:test")
    HFModel(name_or_path="owner/model").preflight()


def test_a_hub_models_identity_follows_the_commit_its_branch_points_at(monkeypatch, tmp_path):
    """Caches of what the weights give (the KL reference, GPTQ checkpoints) were keyed by the revision name: after
    `main` moved to a new commit, the old reference would have scored the new weights."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    repo = tmp_path / "hub" / "models--owner--model"
    (repo / "refs").mkdir(parents=True)
    model = HFModel(name_or_path="owner/model")
    assert model.identity()["commit"] is None  # not downloaded yet
    ids = []
    for sha in ("a" * 40, "b" * 40):  # what snapshot_download leaves: refs/main -> snapshots/<sha>
        (repo / "snapshots" / sha).mkdir(parents=True)
        (repo / "snapshots" / sha / "config.json").write_text("{}")
        (repo / "refs" / "main").write_text(sha)
        ids.append(model.identity())
    assert [i["commit"] for i in ids] == ["a" * 40, "b" * 40] and ids[0] != ids[1]
