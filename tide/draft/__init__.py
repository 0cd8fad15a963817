"""The EAGLE-3 draft head: model, spec (vLLM config), checkpoints and published versions."""

from tide.draft.io import DraftRegistry, init_draft, load_draft, save_draft, set_vocab, target_heads
from tide.draft.model import Eagle3Draft
from tide.draft.spec import DraftSpec

__all__ = ["DraftRegistry", "DraftSpec", "Eagle3Draft", "init_draft", "load_draft", "save_draft", "set_vocab",
           "target_heads"]
