"""notebooks/inspect_run.ipynb executed top to bottom (nbclient) against a real smoke run's tables,
from the local store and from an S3 API (moto) with an endpoint; any cell error fails the test."""

from __future__ import annotations

import base64

import nbformat

from tests.fixtures.smoke_run import REPO, SMOKE_STORE_ROOT, copy_run


def _outputs(nb):
    pngs, texts = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                pngs.append(base64.b64decode(data["image/png"]))
            texts.append(out.get("text", "") + data.get("text/markdown", "") + data.get("text/plain", ""))
    return pngs, "\n".join(texts)


def test_notebook_on_local_run(smoke_run, tmp_path):
    from tasks.inspect import execute_notebook

    nb = nbformat.read(execute_notebook(smoke_run, store=SMOKE_STORE_ROOT, out=str(tmp_path / "out.ipynb")), as_version=4)
    pngs, text = _outputs(nb)
    assert len(pngs) >= 3 and all(p.startswith(b"\x89PNG") for p in pngs)  # curves + two distributions
    assert f"run {smoke_run}" in text and "pass_at_k" in text
    assert "repo_name" in text and "bug_family" in text
    # The trajectory: the conversation, the patch and the hidden tests' statuses.
    assert "**[1] user**" in text and "**final patch**" in text and "**tests**" in text


def test_notebook_on_s3_run(smoke_run, s3_store, s3_endpoint, tmp_path):
    from tasks.inspect import execute_notebook
    from tasks.storage import Store

    copy_run(Store(SMOKE_STORE_ROOT), s3_store, smoke_run)
    out = execute_notebook(smoke_run, store=s3_store.root, endpoint_url=s3_endpoint,
                           out=str(tmp_path / "out.ipynb"))
    pngs, text = _outputs(nbformat.read(out, as_version=4))
    assert len(pngs) >= 3 and f"in {s3_store.root}" in text
