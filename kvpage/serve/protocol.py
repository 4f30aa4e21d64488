"""The OpenAI wire format: request bodies checked field by field, errors in its shape.

Every field is checked by hand rather than by a schema library, so that each refusal
names the field and what it must be, in OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`), with status 400. Options kvpage
does not implement (`n > 1`, `logprobs`, penalties, tools, ...) are refused by name when
set to anything but their no-op default — a client that asked for them must not get
an answer computed without them. Unknown fields are refused too; `user` is accepted as
the metadata it is.

Beyond OpenAI's fields, the extensions of vLLM's server that clients send, with vLLM's
meaning: `top_k`, `ignore_eos` (EOS does not end the request; `stop_token_ids` still
do), `min_tokens` (no stop token or stop string ends the request before it has this
many tokens), `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`
(default true), `priority` (lower = more important), `return_token_ids` (each choice
carries its `token_ids`) and, in `stream_options`, `continuous_usage_stats` (with
`include_usage`: usage so far in every chunk). kvpage's own: `max_queue_wait_s` (the
wait deadline) and, in `stream_options`, `include_status`. `ACCEPTED` lists them all.
"""

import dataclasses
import math
from typing import Any

from kvpage.request import MAX_LOGPROBS  # completions' `logprobs`, chat's `top_logprobs`

SEED_LIMIT = 2**32  # sampling keys are 32-bit on the device
INT32_LIMIT = 2**31
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 16
MAX_N = 16  # completions per request (`n`): each a request of its own in the engine
CHAT_ROLES = ("system", "developer", "user", "assistant")

# Implemented nowhere in kvpage: accepted only at the value that means "off".
_NO_OP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None,),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
}
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
           "skip_special_tokens", "priority", "stream", "stream_options", "return_token_ids",
           "max_queue_wait_s", "user", "n")
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_status")
COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "logprobs", "echo", *_NO_OP_DEFAULTS))
CHAT_FIELDS = frozenset((*_COMMON, "messages", "max_completion_tokens", "logprobs",
                         "top_logprobs", "echo", *_NO_OP_DEFAULTS))
# Every field each endpoint takes (the options in `_NO_OP_DEFAULTS` at their "off" only).
ACCEPTED = {"/v1/completions": sorted(COMPLETION_FIELDS),
            "/v1/chat/completions": sorted(CHAT_FIELDS),
            "stream_options": list(STREAM_OPTIONS)}


class ApiError(Exception):
  """An answer in OpenAI's error shape: HTTP `status`, and headers for push-back."""

  def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
               code: str | None = None, param: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.error_type = error_type
    self.code = code
    self.param = param
    self.headers = headers or {}

  def body(self) -> dict[str, Any]:
    return error_body(self.message, self.error_type, self.code, self.param)


def error_body(message: str, error_type: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
  return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
  return ApiError(400, message, code=code, param=param)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """A checked completion or chat request: what to run and how to answer."""

  chat: bool
  model: str | None
  prompt_text: str | None = None  # completions: text, or
  prompt_ids: list[int] | None = None  # token ids
  messages: list[dict[str, str]] | None = None  # chat: role and text content
  max_tokens: int | None = None  # None: the endpoint's default
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False
  min_tokens: int = 0
  stop_token_ids: tuple[int, ...] = ()
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  priority: int = 0
  stream: bool = False
  include_usage: bool = False
  continuous_usage: bool = False  # with include_usage: usage so far in every chunk
  include_status: bool = False
  return_token_ids: bool = False
  max_queue_wait_s: float | None = None
  # Log-probabilities: None, or how many of the likeliest tokens beside the sampled one
  # (completions' `logprobs: k`; chat's `logprobs: true` with `top_logprobs: k`).
  logprobs: int | None = None
  # Completions: the answer starts with the prompt (with `logprobs`, the prompt tokens'
  # log-probabilities too); `max_tokens` may then be 0 (score the prompt only).
  echo: bool = False
  n: int = 1  # completions of the prompt, each its own choice (`index`)


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))


def _int(body: dict, name: str, low: int, high: int, default: int | None) -> int | None:
  value = body.get(name)
  if value is None:
    return default
  if not _is_int(value) or not low <= value < high:
    raise invalid(name, f"'{name}' must be an integer in [{low}, {high}), got {value!r}")
  return value


def _number(body: dict, name: str, default: float | None, *, low: float, high: float,
            low_open: bool = False) -> float | None:
  value = body.get(name)
  if value is None:
    return default
  if not _is_number(value) or not (value > low if low_open else value >= low) or value > high:
    bound = "(" if low_open else "["
    raise invalid(name, f"'{name}' must be a number in {bound}{low:g}, {high:g}], got "
                  f"{value!r}")
  return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
  value = body.get(name)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise invalid(name, f"'{name}' must be true or false, got {value!r}")
  return value


def _check_fields(body: Any, allowed: frozenset[str]) -> dict:
  if not isinstance(body, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                   code="invalid_body")
  unknown = sorted(set(body) - allowed)
  if unknown:
    raise invalid(unknown[0], f"unknown field(s) {', '.join(map(repr, unknown))}",
                  code="unknown_field")
  unsupported = sorted(name for name, defaults in _NO_OP_DEFAULTS.items()
                       if name in body and not any(_same(body[name], d) for d in defaults))
  if unsupported:
    raise invalid(unsupported[0], f"unsupported option(s) {', '.join(map(repr, unsupported))}: "
                  "kvpage serves without best_of, suffix, penalties, logit bias, tools or "
                  "response formats",
                  code="unsupported_option")
  return body


def _same(value: Any, default: Any) -> bool:
  """`value == default`, without counting True as 1 or 0 as False."""
  if default is None or isinstance(default, bool):
    return value is default
  if _is_number(default):
    return _is_number(value) and value == default
  return type(value) is type(default) and value == default


def scalar_values(value: str, param: str) -> str:
  """`value`, if it is text: Unicode scalar values only. JSON can carry a lone surrogate
  (`"\\ud800"`), which no tokenizer or UTF-8 response can hold."""
  if not value.isascii():
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as error:
      raise invalid(param, f"'{param}' holds a lone surrogate ({value[error.start]!r} at "
                    f"character {error.start}): text must be Unicode scalar values",
                    code="invalid_text") from None
  return value


def _stop(body: dict) -> tuple[str, ...]:
  value = body.get("stop")
  if value is None:
    return ()
  stops = [value] if isinstance(value, str) else value
  if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
      or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in stops)):
    raise invalid("stop", f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} "
                  f"non-empty strings of at most {MAX_STOP_LENGTH} characters")
  return tuple(scalar_values(stop, "stop") for stop in stops)


def _stop_token_ids(body: dict) -> tuple[int, ...]:
  value = body.get("stop_token_ids")
  if value is None:
    return ()
  if (not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS
      or not all(_is_int(i) and 0 <= i < INT32_LIMIT for i in value)):
    raise invalid("stop_token_ids", f"'stop_token_ids' must be a list of at most "
                  f"{MAX_STOP_TOKEN_IDS} token ids (integers >= 0)")
  return tuple(value)


def _common(body: dict, *, chat: bool, max_tokens_field: str = "max_tokens") -> dict:
  """The fields both endpoints share, checked."""
  model = body.get("model")
  if model is not None and not isinstance(model, str):
    raise invalid("model", f"'model' must be a string, got {model!r}")
  if model is not None:
    scalar_values(model, "model")
  stream = _bool(body, "stream")
  options = body.get("stream_options")
  if options is not None:
    if not stream:
      raise invalid("stream_options", "'stream_options' is only allowed with 'stream': true")
    if not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS):
      raise invalid("stream_options", f"'stream_options' takes {', '.join(STREAM_OPTIONS)} "
                    "(each true or false)")
  options = options or {}
  top_k = _int(body, "top_k", -1, INT32_LIMIT, 0)
  max_tokens = _int(body, max_tokens_field, 1, INT32_LIMIT, None)
  min_tokens = _int(body, "min_tokens", 0, INT32_LIMIT, 0) or 0
  if max_tokens is not None and min_tokens > max_tokens:
    raise invalid("min_tokens", f"'min_tokens' ({min_tokens}) exceeds '{max_tokens_field}' "
                  f"({max_tokens})")
  return dict(
      chat=chat, model=model, max_tokens=max_tokens, min_tokens=min_tokens,
      n=_int(body, "n", 1, MAX_N + 1, 1),
      stop_token_ids=_stop_token_ids(body),
      include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
      skip_special_tokens=_bool(body, "skip_special_tokens", True),
      continuous_usage=_bool(options, "continuous_usage_stats"),
      temperature=_number(body, "temperature", 1.0, low=0.0, high=100.0),
      top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
      top_k=max(0, top_k or 0),  # -1 (vLLM) and 0 both mean off
      seed=_int(body, "seed", 0, SEED_LIMIT, None), stop=_stop(body),
      ignore_eos=_bool(body, "ignore_eos"),
      priority=_int(body, "priority", -INT32_LIMIT, INT32_LIMIT, 0),
      stream=stream, include_usage=_bool(options, "include_usage"),
      include_status=_bool(options, "include_status"),
      return_token_ids=_bool(body, "return_token_ids"),
      max_queue_wait_s=_number(body, "max_queue_wait_s", None, low=0.0, high=1e9,
                               low_open=True))


def parse_completion(body: Any) -> GenerationRequest:
  """`POST /v1/completions`: `prompt` is text or token ids (one prompt per request)."""
  body = _check_fields(body, COMPLETION_FIELDS)
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  text, ids = None, None
  if isinstance(prompt, str):
    if not prompt:
      raise invalid("prompt", "'prompt' is empty", code="empty_prompt")
    text = scalar_values(prompt, "prompt")
  elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
    # `type(t) is int`, not `_is_int`: JSON ints decode to exactly int (no bools, no
    # subclasses), and a long prompt's ids are checked at a third of the cost.
    ids = list(prompt)
  elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    raise invalid("prompt", f"'prompt' holds {len(prompt)} prompts; kvpage takes one per "
                  "request (send them concurrently)", code="unsupported_option")
  else:
    raise invalid("prompt", "'prompt' must be a non-empty string or a non-empty list of "
                  "integer token ids", code="invalid_prompt")
  logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS + 1, None)
  echo = _bool(body, "echo")
  common = _common({**body, "max_tokens": None} if echo and body.get("max_tokens") == 0
                   else body, chat=False)
  if echo and body.get("max_tokens") == 0:  # scoring the prompt only
    if common["min_tokens"]:
      raise invalid("min_tokens", "'min_tokens' exceeds 'max_tokens' (0)")
    common["max_tokens"] = 0
  return GenerationRequest(prompt_text=text, prompt_ids=ids, logprobs=logprobs, echo=echo,
                           **common)


def parse_chat(body: Any) -> GenerationRequest:
  """`POST /v1/chat/completions`: `messages` through the checkpoint's chat template."""
  body = _check_fields(body, CHAT_FIELDS)
  if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
    raise invalid("max_completion_tokens", "set 'max_tokens' or 'max_completion_tokens', "
                  "not both")
  field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
      "max_tokens")
  if body.get("echo") not in (None, False):
    raise invalid("echo", "'echo' is a completions option: chat does not echo its messages",
                  code="unsupported_option")
  top = _int(body, "top_logprobs", 0, MAX_LOGPROBS + 1, None)
  if top is not None and not _bool(body, "logprobs"):
    raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
  return GenerationRequest(messages=_messages(body.get("messages")),
                           logprobs=(top or 0) if _bool(body, "logprobs") else None,
                           **_common(body, chat=True, max_tokens_field=field))


def _messages(value: Any) -> list[dict[str, str]]:
  if not isinstance(value, list) or not value:
    raise invalid("messages", "'messages' must be a non-empty list of {role, content} objects")
  messages = []
  for index, message in enumerate(value):
    where = f"messages[{index}]"
    if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
      raise invalid(where, f"'{where}' must be an object with 'role', 'content' and an "
                    "optional 'name' (tool calls are not supported)")
    role = message.get("role")
    if role not in CHAT_ROLES:
      raise invalid(f"{where}.role", f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, "
                    f"got {role!r}")
    messages.append({"role": role, "content": _content(message.get("content"), where)})
  return messages


def _content(content: Any, where: str) -> str:
  """Text content: a string, or a list of `{"type": "text", "text": ...}` parts."""
  if isinstance(content, str):
    return scalar_values(content, f"{where}.content")
  if isinstance(content, list) and all(
      isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
      for part in content):
    return scalar_values("".join(part["text"] for part in content), f"{where}.content")
  raise invalid(f"{where}.content", f"'{where}.content' must be a string or a list of text "
                "parts (images and audio are not supported)")
