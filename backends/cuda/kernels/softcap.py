import triton
import triton.language as tl


@triton.jit
def softcap_scores(s, softcap):
    """softcap * tanh(s / softcap) (Gemma 2's attention logits); tanh from a sigmoid, which every
    Triton backend and the interpreter have: tanh(x) = 2 * sigmoid(2x) - 1, exact at +-inf."""
    return softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
