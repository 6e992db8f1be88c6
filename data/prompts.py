"""Prompts for GSM8K / MATH-500 / arith: the tokenizer's chat template when it has one, else plain text.

With a chat template the question (plus the answer-format instruction) is the user turn and the
prompt ends with the assistant header (``add_generation_prompt=True``). Without one the prompt is
``"Question: ...\\nAnswer:"`` with the instruction on the line before.
"""

from __future__ import annotations

from typing import Any

INSTRUCTIONS = {
    "gsm8k": "Solve the problem step by step. Give the final answer as a number after '####' "
    "(for example: #### 42), or inside \\boxed{}.",
    "math500": "Solve the problem step by step. Put your final answer in \\boxed{}.",
    "arith": "Work it out digit by digit. Give the final answer as a number after '####'.",
}


def instruction_for(benchmark: str | None) -> str:
    """The answer-format instruction for ``benchmark`` (the MATH one for unknown/None)."""
    return INSTRUCTIONS.get(benchmark or "", INSTRUCTIONS["math500"])


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def user_message(question: str, benchmark: str | None = None) -> dict[str, str]:
    """The user turn of a chat prompt: the question, a blank line, the benchmark's instruction."""
    return {"role": "user", "content": f"{question.strip()}\n\n{instruction_for(benchmark)}"}


def build_prompt(tokenizer: Any, question: str, benchmark: str | None = None, system: str | None = None,
                 use_chat_template: bool | None = None) -> str:
    """The prompt text for ``question``.

    ``use_chat_template``: None = use it when the tokenizer has one; True requires one (ValueError
    otherwise); False forces the plain format.
    """
    instruction = instruction_for(benchmark)
    has = tokenizer is not None and has_chat_template(tokenizer)
    if use_chat_template and not has:
        raise ValueError("use_chat_template=True but the tokenizer has no chat template")
    if use_chat_template is None:
        use_chat_template = has
    if use_chat_template:
        messages = []
        if system:
            messages.append({"role": "system", "content": system})
        messages.append(user_message(question, benchmark))
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head = f"{system.strip()}\n\n" if system else ""
    return f"{head}{instruction}\n\nQuestion: {question.strip()}\nAnswer:"


def build_prompts(tokenizer: Any, questions: list[str], benchmark: str | None = None, **kw: Any) -> list[str]:
    return [build_prompt(tokenizer, q, benchmark, **kw) for q in questions]
