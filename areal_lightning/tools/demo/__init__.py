"""The demo job: a tiny Llama learns addition (``"17+25=42"``) while HFSaverCallback exports it
and RecoverCallback makes it survive a SIGKILL.

Nothing is downloaded: the model is built from a ``LlamaConfig`` and the character-level
tokenizer with the ``tokenizers`` library (wrapped as ``PreTrainedTokenizerFast``, so a real
``tokenizer.json`` is exported). Run it with ``areal-lightning demo [--config FILE] [key=value ...]``.

With ``kill.enabled`` (the default) the training runs in worker processes
(``python -m areal_lightning.tools.demo --worker CONFIG --losses FILE``, each appending its
per-step losses to ``FILE``): the trial is trained once without interruption (the reference,
trial ``{trial_name}-reference``) and, side by side, once more in trial ``{trial_name}``,
whose worker gets a real ``SIGKILL`` mid-epoch, between two recover checkpoints, is started
again with the same command, resumes from the last recover checkpoint and finishes. The
demo prints both runs' per-step losses, compares every one bit for bit (and the final HF
exports byte for byte) and raises :class:`DemoMismatchError` when anything differs.
With ``kill.enabled: false`` it trains once, in this process.

Step numbers in the demo's output and summary count optimizer steps from 1 (``trainer.global_step``
after the step); the folder names and ``recover_info/`` count from 0 (step 250 is ``globalstep249``).
"""

from __future__ import annotations

from typing import Any

from areal_lightning.tools.demo.config import DemoConfig, DemoKillConfig, DemoMismatchError, DemoTrainConfig
from areal_lightning.tools.demo.kill import compare_runs
from areal_lightning.tools.demo.model import AdditionDataset, _tiny_causal_lm_class, build_tokenizer, generate
from areal_lightning.tools.demo.run import run_demo
from areal_lightning.tools.demo.train import worker_threads

__all__ = ["DemoConfig", "DemoTrainConfig", "DemoKillConfig", "DemoMismatchError", "build_tokenizer",
           "AdditionDataset", "TinyCausalLM", "run_demo", "compare_runs", "generate", "worker_threads"]


def __getattr__(name: str) -> Any:  # TinyCausalLM without importing Lightning with this module
    if name == "TinyCausalLM":
        return _tiny_causal_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
