"""The example specs stay valid."""

from pathlib import Path

import pytest
import yaml

from tasks.spec import RunSpec

SPECS = sorted((Path(__file__).parent.parent / "examples" / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_every_example_spec_validates(path):
    RunSpec(**yaml.safe_load(path.read_text()))


def test_the_real_demo_spec_validates():
    from flows.cli import REAL_DEMO_CONFIGS, real_demo_spec

    for algorithm in REAL_DEMO_CONFIGS:
        spec = RunSpec(**real_demo_spec(algorithm, "./models/smollm2", "./runs", seed=3, items=8))
        assert spec.task == "writing" and spec.trainer_config().seed == 3 and spec.train_dataset.limit == 8
