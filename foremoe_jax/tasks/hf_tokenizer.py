"""A Hugging Face `tokenizer.json` tokenizer for text tasks.

Sits at the start and the end of the data flow for tasks on real text: a task
renders each problem through the checkpoint's chat template and encodes it to
the int32 prompt ids the sampler consumes, and decodes the generated ids back
to text that a verifier (foremoe_jax.tasks.rewards) scores. It plays the part
CharTokenizer plays for the toy tasks (`vocab_size`, `encode`, `decode`), plus
the special-token ids the sampler needs (`pad_id`, `bos_id`, `eos_id`).

Only the `tokenizers` library and Jinja2 are used, not `transformers`: a
checkpoint directory's `tokenizer.json` and `tokenizer_config.json` hold all
that is needed.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers

# Fallback special-token names, tried in order when neither the caller nor
# tokenizer_config.json names the token.
EOS_CANDIDATES = ('<|endoftext|>', '</s>', '<eos>', '<|im_end|>', '[SEP]')
BOS_CANDIDATES = ('<s>', '<bos>', '<|begin_of_text|>', '[CLS]')
PAD_CANDIDATES = ('<pad>', '[PAD]', '<|pad|>')

TOKENIZER_FILE = 'tokenizer.json'
CONFIG_FILE = 'tokenizer_config.json'
# Where a checkpoint lists every id that ends generation (`eos_token_id`, an
# int or a list: Qwen3 instruct ends turns with '<|im_end|>' and text with
# '<|endoftext|>', and either may come first).
GENERATION_CONFIG_FILE = 'generation_config.json'
# Recent transformers versions save the chat template in its own file
# instead of a tokenizer_config.json field.
CHAT_TEMPLATE_FILE = 'chat_template.jinja'


class HFTokenizer:
  """A `tokenizers.Tokenizer` with resolved special tokens and a chat template.

  PAD defaults to EOS when the vocabulary has no pad token. That is safe for
  this framework: generation writes PAD only after EOS, and the sampler masks
  only the leading PADs of a left-padded prompt, so PAD == EOS is never
  ambiguous as long as a prompt does not start with EOS.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str,
               bos_token: str | None = None, pad_token: str | None = None,
               chat_template: str | None = None,
               stop_tokens: Sequence[str] = ()):
    """Wraps `tokenizer`; see `from_path` for how the arguments are found.

    Args:
      tokenizer: The loaded `tokenizers.Tokenizer`.
      eos_token: End-of-sequence token string; must be in the vocabulary.
        Warm-start solutions end with it.
      bos_token: Beginning-of-sequence token string, or None for none.
      pad_token: Padding token string, or None to pad with EOS.
      chat_template: Jinja2 template text, or None to use prompts as is.
      stop_tokens: Further token strings that end a completion as EOS does
        (`stop_ids`); EOS itself may be among them.

    Raises:
      ValueError: A token string is not in the vocabulary, or the template
        does not compile.
    """
    self._tokenizer = tokenizer
    # Added special tokens written in the text (a template's '<|im_start|>')
    # must map to their ids, not be split into pieces; that is the library's
    # default, set here so a caller's earlier change cannot leak in.
    self._tokenizer.encode_special_tokens = False
    # A tokenizer.json may carry truncation or padding settings
    # (transformers' save_pretrained writes the last call's): encode would
    # then cut a long prompt from the right, past the length check that
    # skips it, or pad it on the wrong side. transformers turns both off on
    # every call that does not ask for them; so do we, once.
    self._tokenizer.no_truncation()
    self._tokenizer.no_padding()
    self.eos_token = eos_token
    self.bos_token = bos_token
    self.pad_token = eos_token if pad_token is None else pad_token
    self._eos_id = self._id_of(eos_token, 'eos_token')
    self._bos_id = None if bos_token is None else self._id_of(bos_token,
                                                              'bos_token')
    self._pad_id = self._id_of(self.pad_token, 'pad_token')
    if isinstance(stop_tokens, str):
      raise ValueError(f'stop_tokens must be a list of token strings, got the '
                       f'string {stop_tokens!r}.')
    self.stop_tokens = tuple(t for t in dict.fromkeys(stop_tokens)
                             if t != eos_token)
    self._stop_ids = tuple(self._id_of(t, 'stop token')
                           for t in self.stop_tokens)
    self.chat_template = chat_template
    # Compiled once here so a broken template fails at load time, not at the
    # first rollout.
    self._template = (None if chat_template is None
                      else _template_environment().from_string(chat_template))

  @classmethod
  def from_path(cls, path: str | os.PathLike[str], *,
                chat_template: str | None = None,
                pad_token: str | None = None,
                bos_token: str | None = None,
                eos_token: str | None = None,
                stop_tokens: Sequence[str] | None = None) -> HFTokenizer:
    """Loads a `tokenizer.json`, or the one in a checkpoint directory.

    Each special token comes from, in order: the argument; the same field of
    `tokenizer_config.json` beside the tokenizer file (a string, or a dict
    with 'content'; null counts as absent); the first of the common names
    (EOS_CANDIDATES, BOS_CANDIDATES, PAD_CANDIDATES) in the vocabulary. EOS is
    required, BOS may be None, and a missing PAD falls back to EOS.

    Args:
      path: A `tokenizer.json` file, or a directory holding one.
      chat_template: None for no template (prompts used as is); 'auto' for the
        checkpoint's template (`chat_template` in tokenizer_config.json, else
        a `chat_template.jinja` file); anything else is Jinja2 template text.
      pad_token: Padding token string, overriding the config.
      bos_token: Beginning-of-sequence token string, overriding the config.
      eos_token: End-of-sequence token string, overriding the config.
      stop_tokens: Further tokens that end a completion; None for the other
        ids of `eos_token_id` in `generation_config.json` beside the
        tokenizer (none when the file is absent).

    Returns:
      The tokenizer.

    Raises:
      FileNotFoundError: No tokenizer file at `path`.
      ValueError: No EOS token found, a named token is not in the vocabulary,
        or 'auto' finds no chat template.
    """
    path = os.fspath(path)
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise FileNotFoundError(f'no Hugging Face tokenizer file at {file!r} '
                              f'(from path {path!r}).')
    directory = os.path.dirname(os.path.abspath(file))
    config = _read_config(os.path.join(directory, CONFIG_FILE))
    tokenizer = tokenizers.Tokenizer.from_file(file)

    def resolve(field, explicit, candidates):
      if explicit is not None:
        return explicit
      from_config = _token_content(config.get(field))
      if from_config is not None:
        return from_config
      return next((c for c in candidates
                   if tokenizer.token_to_id(c) is not None), None)

    eos = resolve('eos_token', eos_token, EOS_CANDIDATES)
    if eos is None:
      raise ValueError(
          f'no EOS token for {file!r}: none given, no eos_token in '
          f'{CONFIG_FILE}, and none of {list(EOS_CANDIDATES)} is in the '
          'vocabulary; pass eos_token=.')
    if chat_template == 'auto':
      chat_template = _auto_chat_template(config, directory)
    if stop_tokens is None:
      stop_tokens = _generation_stop_tokens(
          os.path.join(directory, GENERATION_CONFIG_FILE), tokenizer)
    return cls(tokenizer, eos_token=eos,
               bos_token=resolve('bos_token', bos_token, BOS_CANDIDATES),
               pad_token=resolve('pad_token', pad_token, PAD_CANDIDATES),
               chat_template=chat_template, stop_tokens=stop_tokens)

  # Special tokens and sizes.

  @property
  def vocab_size(self) -> int:
    """Ids the tokenizer can produce, added tokens included.

    A checkpoint's embedding table may have more rows (padded for speed); the
    model's size, not this one, sets the logits' width.
    """
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids other than `eos_id` that also end a completion."""
    return self._stop_ids

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def pad_id(self) -> int:
    return self._pad_id

  # Text <-> ids.

  def render_prompt(self, text: str, system_prompt: str | None = None,
                    **template_vars) -> str:
    """`text` as a user turn in the chat template, ready for generation.

    Without a template the text is returned as is. template_vars are extra
    template variables, as `apply_chat_template(**kwargs)` passes them
    (Qwen3's `enable_thinking=False` closes an empty think block).

    Raises:
      ValueError: `system_prompt` given without a chat template, or the
        template itself raised (HF templates call `raise_exception`).
    """
    if self._template is None:
      if template_vars:
        raise ValueError(f'template variables {sorted(template_vars)} need a '
                         'chat template.')
      if system_prompt is not None:
        raise ValueError('system_prompt needs a chat template; load with '
                         "chat_template='auto' or a template text.")
      return text
    messages = []
    if system_prompt is not None:
      messages.append({'role': 'system', 'content': system_prompt})
    messages.append({'role': 'user', 'content': text})
    return self._template.render(
        **{**template_vars, 'messages': messages,
           'add_generation_prompt': True, 'bos_token': self.bos_token or '',
           'eos_token': self.eos_token or ''})

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Ids of `text`.

    Special tokens written in the text (a rendered template's BOS or
    '<|im_start|>') become their ids. add_special_tokens=False by default
    because a chat template already writes the BOS it wants; True applies the
    tokenizer's post-processor (which may add BOS/EOS) on top.
    """
    return self._tokenizer.encode(
        text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str],
                   add_special_tokens: bool = False) -> list[list[int]]:
    """`encode` for many texts at once (the library runs them in parallel)."""
    encodings = self._tokenizer.encode_batch(
        list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encodings]

  def decode(self, ids: Sequence[int] | np.ndarray, stop_at_eos: bool = True
             ) -> str:
    """Text of `ids`: ends at the first EOS or stop id, drops PAD, BOS, EOS
    and the stop ids.

    Ids outside [0, vocab_size) are dropped rather than raised on: the model's
    embedding table can be wider than the vocabulary, and a sampled padding
    row must not crash a rollout. Other added tokens (say '<|im_start|>') are
    kept in the text, so logs show them.
    """
    flat = np.asarray(ids).reshape(-1).tolist()
    ends = {self._eos_id, *self._stop_ids}
    if stop_at_eos:
      end = next((i for i, t in enumerate(flat) if t in ends), len(flat))
      flat = flat[:end]
    skip = {self._pad_id, *ends}
    if self._bos_id is not None:
      skip.add(self._bos_id)
    size = self.vocab_size
    kept = [int(i) for i in flat if 0 <= i < size and i not in skip]
    return self._tokenizer.decode(kept, skip_special_tokens=False)

  def __repr__(self) -> str:
    return (f'HFTokenizer(vocab_size={self.vocab_size}, '
            f'eos={self.eos_token!r}, bos={self.bos_token!r}, '
            f'pad={self.pad_token!r}, stop={list(self.stop_tokens)!r}, '
            f'chat_template={self.chat_template is not None})')

  def _id_of(self, token: str, field: str) -> int:
    token_id = self._tokenizer.token_to_id(token)
    if token_id is None:
      raise ValueError(f'{field} {token!r} is not in the vocabulary.')
    return token_id


# Helpers for from_path and the template.


def _read_config(path: str) -> dict[str, Any]:
  """tokenizer_config.json as a dict; {} when the file is absent."""
  if not os.path.isfile(path):
    return {}
  with open(path, encoding='utf-8') as f:
    config = json.load(f)
  if not isinstance(config, dict):
    raise ValueError(f'{path!r} does not hold a JSON object.')
  return config


def _generation_stop_tokens(path: str, tokenizer: tokenizers.Tokenizer
                            ) -> tuple[str, ...]:
  """The tokens of generation_config.json's `eos_token_id` (an int or a
  list of ints); () when the file or the field is absent."""
  ids = _read_config(path).get('eos_token_id')
  if ids is None:
    return ()
  ids = [ids] if isinstance(ids, int) else ids
  if not isinstance(ids, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise ValueError(f'{path!r}: eos_token_id must be an int or a list of '
                     f'ints, got {ids!r}.')
  tokens = []
  for i in ids:
    token = tokenizer.id_to_token(i)
    if token is None:
      raise ValueError(f'{path!r}: eos_token_id {i} is not in the '
                       'vocabulary.')
    tokens.append(token)
  return tuple(tokens)


def _token_content(value: Any) -> str | None:
  """A config token field: a string, or a dict ({'content': ..., ...})."""
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) else None


def _auto_chat_template(config: dict[str, Any], directory: str) -> str:
  """The checkpoint's own chat template."""
  template = config.get('chat_template')
  if isinstance(template, list):
    # Older multi-template form: [{'name': 'default', 'template': ...}, ...].
    named = {t.get('name'): t.get('template') for t in template
             if isinstance(t, dict)}
    template = named.get('default')
  if isinstance(template, str):
    return template
  jinja_file = os.path.join(directory, CHAT_TEMPLATE_FILE)
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding='utf-8') as f:
      return f.read()
  raise ValueError(
      f"chat_template='auto' but {directory!r} has no chat template: neither "
      f'a chat_template field in {CONFIG_FILE} nor a {CHAT_TEMPLATE_FILE}.')


def _raise_exception(message: str):
  # HF chat templates call raise_exception(...) to reject a conversation.
  raise ValueError(f'chat template error: {message}')


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
  # Jinja2's own tojson HTML-escapes '<', '>' and '&'; HF templates expect
  # plain JSON (as transformers renders it), e.g. for tool schemas.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  """The Jinja2 environment transformers renders chat templates in.

  Sandboxed because the template comes with a downloaded checkpoint.
  `strftime_now` is left undefined on purpose: templates that test for it
  then fall back to a fixed date, keeping prompts reproducible.
  """
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols])
  env.globals['raise_exception'] = _raise_exception
  env.filters['tojson'] = _tojson
  return env
