"""OpenAI request bodies (pydantic, strict types: "16" is not a max_tokens) and the error body.

Fields OpenAI defines but this server does not implement are declared so that a request using them
gets a 400 naming the field instead of being silently ignored; unknown extra fields are ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from ..sampling_params import MAX_LOGPROBS

Number = float  # strict mode still accepts JSON integers for floats
MAX_CHOICES = 16  # choices a request may ask for: its prompts × n
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: int | None = Field(None, description="Extension: keep the k most likely tokens; 0 or -1 = off.")
    min_p: Number | None = Field(None, description="Extension (vLLM's): drop the tokens less likely than min_p times "
                                                   "the most likely one, in [0, 1]; 0 = off.")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices a prompt: as many requests, seeded seed + j.")
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = Field(None, description="Extension: CTRL's penalty on prompt and output "
                                                                "tokens; 1 = off.")
    logit_bias: dict[str, Number] | None = Field(None, description="{token id: bias in [-100, 100]}.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: token ids that end the output.")
    min_tokens: int = Field(0, description="Extension: tokens before EOS, a stop id or a stop string may end it.")
    response_format: dict | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    skip_special_tokens: bool = Field(True, description="Extension (vLLM's): leave special tokens out of the text.")
    return_token_ids: bool = Field(False, description="Extension (vLLM's): the generated token ids in each choice, "
                                   "the prompt's in a completion choice and at a chat response's top level.")

    @field_validator("n", "stream", "ignore_eos", "skip_special_tokens", "return_token_ids", "min_tokens", "echo",
                     "max_tokens", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v, info):
        """OpenAI types these "X or null": an explicit null is the default (completions' max_tokens 16), not a
        type error."""
        return cls.model_fields[info.field_name].default if v is None else v

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to something this server cannot do."""
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", ("response_format: only {\"type\": \"text\"} is supported (no JSON mode or "
                                       "structured output)")
        return None

    def out_of_range(self) -> tuple[str, str] | None:
        """(field, message) for the first field past the OpenAI API's limits (the Python API's SamplingParams takes
        more, as vLLM's server does). Any number of stop strings is taken, as vLLM's server takes them: OpenAI's 4 would
        refuse the evaluation harnesses' lists (HumanEval's 5 to 7 stop strings) that vLLM-compatible servers serve."""
        t = self.temperature
        if t is not None and not 0 <= t <= MAX_TEMPERATURE:  # (NaN too)
            return "temperature", f"temperature: expected a number in [0, {MAX_TEMPERATURE:g}], got {t!r}"
        return None

    def penalties(self) -> dict:
        """SamplingParams' penalty fields (logit_bias with int token ids); ValueError names a key that is not one."""
        bias = []  # pairs: SamplingParams refuses an id given twice ("5" and "05")
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdecimal()):
                raise ValueError(f"logit_bias: key {key!r} is not a token id")
            bias.append((int(key), value))
        return {"presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "logit_bias": bias}


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, description="0 with echo: the prompt alone (and its logprobs).")
    echo: bool = Field(False, description="The prompt before the output (with logprobs: the prompt tokens' too).")
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Each token's logprob and this many most likely alternatives.")

    def wanted_logprobs(self) -> int | None:
        """SamplingParams.logprobs."""
        return self.logprobs

    def unsupported(self):
        if self.suffix:
            return "suffix", "suffix: not supported"
        if self.best_of is not None and self.best_of < self.n:  # as OpenAI: best_of picks n of best_of candidates
            return "best_of", f"best_of: must be at least n ({self.n}), got {self.best_of}"
        if self.best_of not in (None, 1):
            return "best_of", "best_of: only 1 is supported"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="JSON text, as the model wrote it; the template gets it as sent.")


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    def text(self) -> str | None:
        if self.content is None:
            return None
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def problem(self) -> str | None:
        """What is missing or out of place for its role (OpenAI's rules), as "field: why"."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content: required" + (" (an assistant message may leave it out only with tool_calls)"
                                          if self.role == "assistant" else "")
        if self.tool_calls is not None and self.role != "assistant":
            return "tool_calls: only an assistant message carries tool calls"
        if self.role == "tool" and not self.tool_call_id:
            return "tool_call_id: required in a tool message (the id of the call it answers)"
        if self.tool_call_id is not None and self.role != "tool":
            return "tool_call_id: only a tool message answers a call"
        return None

    def for_template(self) -> dict:
        """The message as a chat template gets it from transformers' apply_chat_template: the client's fields (a
        content left out stays out), "developer" as "system" (OpenAI's new name for it; templates, Kimi's included,
        know only the latter), text parts joined."""
        m = {"role": "system" if self.role == "developer" else self.role}
        if "content" in self.model_fields_set:
            m["content"] = self.text()
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls is not None:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDefinition(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # other keys (OpenAI's "strict") reach the template too
    # OpenAI's rule; the parser also needs it: the model writes the name between a "." and a ":"
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


_TOOLS = TypeAdapter(list[Tool])


def loc_path(loc) -> str:
    """A pydantic error location as a path: tools[1].function.name."""
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # the tools' dicts reach the chat template as the client sent them (validated against Tool, not rewritten)
    tools: list | None = None
    tool_choice: str | dict | None = Field(None, description='"auto" (the default with tools), "none" (tools in '
                                                             'the prompt, the output not parsed into calls), '
                                                             '"required" or a function by name (a call forced by '
                                                             "the answer's opening).")
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def wanted_logprobs(self) -> int | None:
        """SamplingParams.logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def parse_tool_calls(self) -> bool:
        """Whether the output is read for tool calls: tools given, tool_choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def unsupported(self):
        if self.functions or self.function_call not in (None, "none"):
            field = "functions" if self.functions else "function_call"
            return field, f"{field}: deprecated by OpenAI and not supported; send tools (and tool_choice) instead"
        for i, m in enumerate(self.messages):
            if problem := m.problem():
                return "messages", f"messages[{i}].{problem}"
        if self.tools:
            try:
                _TOOLS.validate_python(self.tools)
            except ValidationError as e:
                err = e.errors()[0]
                return "tools", f"{loc_path(('tools', *err['loc']))}: {err['msg']}"
        if (bad := self._bad_tool_choice()) is not None:
            return "tool_choice", bad
        if self.audio:
            return "audio", "audio: audio output is not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs: needs logprobs set to true"
        return super().unsupported()

    def _bad_tool_choice(self) -> str | None:
        c = self.tool_choice
        if c is not None and c != "none" and not self.tools:  # OpenAI's and vLLM's 400: nothing to choose from
            return f"tool_choice: {c!r} needs tools"
        if c is None or c in ("auto", "none", "required"):
            return None
        if isinstance(c, dict):
            f = c.get("function")
            name = f.get("name") if isinstance(f, dict) else None
            if c.get("type") != "function" or not isinstance(name, str):
                return f'tool_choice: expected {{"type": "function", "function": {{"name": ...}}}}, got {c!r}'
            names = [t["function"]["name"] for t in self.tools]
            if name not in names:
                return f"tool_choice.function.name: {name!r} is not among the tools ({', '.join(names)})"
            return None
        return f'tool_choice: expected "auto", "none", "required" or a function, got {c!r}'

    def past_calls(self) -> int:
        """The tool calls in the conversation so far (Kimi numbers a call's id across the conversation)."""
        return sum(len(m.tool_calls or ()) for m in self.messages)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
