"""How an allocation is attributed to a category: the rules shared by the CUDA and CPU reports.

Every allocation the step makes is described by a `Block`: its size, its allocation number in
the step, the *phase* it was made in (forward, backward, optimizer, or outside those), the
*region* the step was in (loss, attention or none) and what its Python stack showed. A block
live at the peak gets the first category that fits:

1. parameters / gradients / optimizer state: by identity. The block holds a parameter's storage,
   becomes a parameter's `.grad` at some point of its life (a gradient computed early, like the
   fused loss's d_weight, counts from its allocation), or holds a tensor of `optimizer.state`.
2. logits/loss scratch: the block was allocated in the loss region: under the output embedding
   module (`get_output_embeddings()`, or a module named `lm_head`), inside `F.cross_entropy` /
   `F.nll_loss`, or with a stack frame in `fusedops/linear_ce/`, `transformers/loss/`
   (`ForCausalLMLoss`, `fixed_cross_entropy`), Liger's cross-entropy, or a function of
   `fusedops/integrations/` whose name says loss, logits or lm_head; or, in the backward pass, by
   an autograd node created there.
3. attention scratch: the same for the attention region: inside
   `F.scaled_dot_product_attention`, a frame in `fusedops/attention/`, in transformers'
   `integrations/{sdpa,flash,flex}_attention.py` or a function named `*attention_forward`
   (`eager_attention_forward`), or a function of `fusedops/integrations/` whose name says attn
   or attention. This counts everything the attention function allocates, its output and
   softmax statistics included (so even a tiled kernel has O(S) attention scratch), and, in the
   backward pass, what its backward allocates.
4. activations: anything else allocated during the forward pass (and, with activation
   checkpointing, what the backward's recomputation allocates: frames in torch/utils/checkpoint).
5. other: the rest, split in `details`: backward temporaries (gradients of activations on
   their way, and the engine's sums), optimizer temporaries, a transformers KV cache built in
   training (use_cache=True: a DynamicCache copies every layer's k and v; with SDPA those
   copies are also what the attention keeps, so activations shrink by as much), what existed
   before the step (the batch, buffers) and what the step allocated outside those phases.

Backward allocations have no useful Python stack (on CUDA they run on autograd's device
thread), so their region comes from the autograd node that makes them: while the forward runs,
a TorchFunctionMode gives each new node the region the forward was in (a Python
autograd.Function's node by the module of its class when that says attention or loss), and a
pre-hook on the node switches the region when the backward reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

LOSS = "loss"
ATTENTION = "attention"
CACHE = "kv-cache"
NONE = ""

# Phases. BEFORE: the block existed when the step started.
BEFORE, SETUP, FORWARD, BACKWARD, OPTIMIZER, AFTER = ("before", "setup", "forward", "backward",
                                                      "optimizer", "after")

_TRANSFORMERS_ATTENTION_FILES = ("sdpa_attention.py", "flash_attention.py", "flex_attention.py",
                                 "sdpa_paged.py", "flash_paged.py", "eager_paged.py")
# Frames that end the walk of a stack in the backward pass: what lies below them is the code
# that called backward(), not the code that allocates.
_BACKWARD_ENTRY = (("torch/autograd/__init__.py", "backward"),
                   ("torch/autograd/__init__.py", "grad"), ("torch/_tensor.py", "backward"))


def frame_region(filename: str, name: str) -> str | None:
    """LOSS or ATTENTION when a stack frame (file, function) belongs to that region."""
    f = filename.replace("\\", "/")
    if "/fusedops/linear_ce/" in f or "/transformers/loss/" in f:
        return LOSS
    if f.endswith("/transformers/cache_utils.py"):
        return CACHE
    if "/fusedops/attention/" in f:
        return ATTENTION
    if "/liger_kernel/" in f and "cross_entropy" in f:
        return LOSS
    if "/transformers/integrations/" in f and f.rsplit("/", 1)[-1] in _TRANSFORMERS_ATTENTION_FILES:
        return ATTENTION
    low = name.lower()
    if "/fusedops/integrations/" in f:
        if "attn" in low or "attention" in low:
            return ATTENTION
        if any(w in low for w in ("loss", "cross_entropy", "logits", "lm_head")):
            return LOSS
    if low.endswith("attention_forward"):
        return ATTENTION
    if f.endswith("torch/nn/functional.py"):
        if name in ("cross_entropy", "nll_loss"):
            return LOSS
        if name == "scaled_dot_product_attention":
            return ATTENTION
    return None


def is_recompute_frame(filename: str) -> bool:
    return filename.replace("\\", "/").endswith("torch/utils/checkpoint.py")


def is_backward_entry(filename: str, name: str) -> bool:
    f = filename.replace("\\", "/")
    return any(f.endswith(p) and name == n for p, n in _BACKWARD_ENTRY)


def _skip_frame(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return "/fusedops/memory/" in f or f.endswith("torch/utils/_python_dispatch.py") or \
        f.endswith("torch/overrides.py")


def _basename(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


def _is_library(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return "/torch/" in f or "/fusedops/memory/" in f or f.startswith("<")


def stack_facts(frames) -> tuple[str | None, bool, str]:
    """(region or None, recomputed, where) from (filename, line, function) triples, innermost
    first. The innermost frame with a region decides; the walk stops at the call of
    backward(). `where` names the innermost frame outside torch ("file:line function")."""
    region = None
    recompute = False
    where = ""
    for filename, line, name in frames:
        if is_backward_entry(filename, name):
            break
        if _skip_frame(filename):
            continue
        if not where and not _is_library(filename):
            where = f"{_basename(filename)}:{line} {name}"
        if region is None:
            region = frame_region(filename, name)
        if is_recompute_frame(filename):
            recompute = True
    return region, recompute, where


def python_stack_facts(frame, limit: int = 80) -> tuple[str | None, bool, str]:
    """stack_facts of a live Python frame and its callers."""
    frames = []
    while frame is not None and len(frames) < limit:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return stack_facts(frames)


def snapshot_stack_facts(frames) -> tuple[str | None, bool, str]:
    """stack_facts of a CUDA snapshot trace entry's frames (innermost first)."""
    return stack_facts((f.get("filename", ""), f.get("line", 0), f.get("name", ""))
                       for f in frames or ())


def node_region(node, default: str) -> str:
    """The region of an autograd node: a Python autograd.Function's by its module name, else
    the region the forward was in when the node appeared."""
    cls = getattr(type(node), "_forward_cls", None)
    if cls is not None:
        mod = (getattr(cls, "__module__", "") or "").lower()
        name = cls.__name__.lower()
        if "linear_ce" in mod or "cross_entropy" in mod or "cross_entropy" in name:
            return LOSS
        if "attention" in mod or "attn" in mod or "attention" in name:
            return ATTENTION
    return default


@dataclass(eq=False)
class Block:
    """One allocation of the step (or one that existed before it)."""

    size: int
    seq: int = 0  # allocation number within the step; 0 for blocks from before the step
    phase: str = BEFORE
    region: str = NONE  # region of the step when it was allocated
    frame_region: str | None = None  # region its Python stack showed
    recompute: bool = False
    kind: str | None = None  # "parameters", "gradients", "optimizer_state", "input", "buffer"
    where: str = ""  # the innermost stack frame outside torch, when known

    def category(self) -> str:
        if self.kind in ("parameters", "gradients", "optimizer_state"):
            return self.kind
        region = self.frame_region or self.region
        if region == CACHE:
            return "other"
        if region == LOSS:
            return "logits_loss"
        if region == ATTENTION:
            return "attention"
        if self.phase == FORWARD or self.recompute:
            return "activations"
        return "other"

    def detail(self) -> str | None:
        """For category "other": what it was."""
        if self.kind == "input":
            return "batch"
        if self.kind == "buffer":
            return "buffers"
        if self.frame_region == CACHE:
            return "KV cache (use_cache=True)"
        return {BEFORE: "before the step", BACKWARD: "backward temporaries",
                OPTIMIZER: "optimizer temporaries"}.get(self.phase, "outside fwd/bwd/optimizer")


def breakdown(blocks) -> tuple[dict, dict]:
    """({category: bytes}, {detail of "other": bytes}) of live blocks."""
    from fusedops.memory.report import CATEGORIES

    cats = dict.fromkeys(CATEGORIES, 0)
    details: dict = {}
    for b in blocks:
        c = b.category()
        cats[c] += b.size
        if c == "other":
            d = b.detail()
            details[d] = details.get(d, 0) + b.size
    return cats, details
