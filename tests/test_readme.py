"""The README's example DAG runs as written: it defers, the file lands, the run succeeds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.dags.dagbag import DagBag
from engine.store import Store
from engine.testing import run_engine
from tests.helpers import REPO_ROOT, wait_until
from triggers.base import decode_value

pytestmark = pytest.mark.anyio


def readme_dag() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README has no python example"
    assert blocks[0].startswith("# dags/orders.py")
    return blocks[0]


async def test_the_readme_example_defers_and_resumes_when_the_file_lands(
    store: Store, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "orders.py").write_text(readme_dag())
    bag = DagBag(dags)
    dag = bag.collect()["orders"]
    assert not bag.import_errors
    landing = tmp_path / "orders.csv"
    async with run_engine(store) as engine:
        await engine.start_run(dag, "r1", conf={"path": str(landing)})

        async def deferred() -> bool:
            tis = await store.list_task_instances(dag_id="orders", state="deferred")
            return len(tis) == 1

        await wait_until(deferred, what="the wait task to defer")
        assert await store.list_triggers() != []
        landing.write_text("id,amount\n")
        tis = await engine.finish("orders", "r1")
    assert tis["__run__"]["state"] == "success", tis
    assert decode_value(tis["wait"]["result"]) == str(landing)
    assert decode_value(tis["load"]["result"]) == "loaded"
