"""One process of a data-parallel training stage: ``accelerate launch ... -m tasks.stage_worker JOB.json``.

:func:`tasks.stages.run_stage` writes the job (spec, stage, where to resume) and starts the launcher;
every process trains its share, rank 0 publishes the checkpoint and writes ``result.json`` beside the
job for the task to return. Everything printed here reaches the Prefect logger through the task.
"""

import json
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from tasks.spec import RunSpec
from tasks.stages import train_stage


@record  # the launcher's failure report then ends with the failing rank's exception: the task's error names it
def main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    ref = train_stage(RunSpec(**job.pop("spec")), job, lambda line: print(line, flush=True))
    if ref is not None:
        (Path(job["work"]) / "result.json").write_text(json.dumps(ref))


if __name__ == "__main__":
    main(sys.argv[1])
