"""Drafts without a draft model: tokens proposed from the request's own text (its prompt and the tokens
generated so far), which a verify call then checks (runtime.speculation). A draft costs no engine call.

A drafter is one object per row with `propose(text, count)`; a draft model would be another such
object. Two are here, each proposing only from a match of at least `shortest` tokens (run
--draft-min-match; a shorter match is as likely a coincidence as a pattern):

    suffix   (the default) a suffix automaton over the text, extended a token at a time: the longest
             suffix of the text that occurred before, at any length, and what followed it (as
             SuffixDecoding's suffix tree finds it, without its frequency counts)
    ngram    prompt lookup: the last n tokens (n from `longest` down to `shortest`) found earlier in
             the text, the tokens that followed their latest earlier occurrence proposed; an index of
             each n-gram's latest end, extended a token at a time

Both cost a few dictionary operations a new token, whatever the text's length (docs/benchmarks.md);
`earlier_match` is the naive search, their reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Drafter(Protocol):
    def propose(self, text: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens to follow `text`, a row's prompt and tokens so far (which only grows
        from one call to the next)."""
        ...


def earlier_match(text: Sequence[int], longest: int) -> tuple[int, int]:
    """(length, end) of the longest suffix of `text`, of at most `longest` tokens, that also ends at an
    earlier position `end` (the latest such); (0, -1) when none does. Quadratic: the naive search, and
    the reference the suffix automaton is tested against."""
    n = len(text)
    for length in range(min(longest, n - 1), 0, -1):
        suffix = list(text[n - length:])
        for end in range(n - 2, length - 2, -1):
            if list(text[end - length + 1:end + 1]) == suffix:
                return length, end
    return 0, -1


@dataclass
class NgramDrafter:
    """Prompt lookup: the last `longest` tokens, or fewer down to `shortest`, found earlier in the text.
    `ends` maps every n-gram (n up to `longest`) to its latest end before the text's last token."""

    longest: int = 3
    shortest: int = 1
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    consumed: int = 0  # ends indexed: 0 up to consumed - 1

    def propose(self, text: Sequence[int], count: int) -> list[int]:
        for end in range(self.consumed, len(text) - 1):
            for n in range(1, min(self.longest, end + 1) + 1):
                self.ends[tuple(text[end - n + 1:end + 1])] = end
        self.consumed = max(self.consumed, len(text) - 1)
        for n in range(min(self.longest, len(text) - 1), self.shortest - 1, -1):
            end = self.ends.get(tuple(text[len(text) - n:]))
            if end is not None:
                return list(text[end + 1:end + 1 + count])
        return []


@dataclass
class SuffixDrafter:
    """A suffix automaton of the text (Blumer et al.), one state per class of substrings that end at
    the same positions: `link` to the longest suffix in another class, `length` of its longest
    substring, `end` an earlier position where it ends. The text's own state's link is the longest
    suffix that occurred before; its `end` says where. Extending costs amortised O(1) a token. Drafts
    follow a match of at least `shortest` tokens."""

    shortest: int = 1
    length: list[int] = field(default_factory=lambda: [0])
    link: list[int] = field(default_factory=lambda: [-1])
    end: list[int] = field(default_factory=lambda: [-1])
    next: list[dict[int, int]] = field(default_factory=lambda: [{}])
    last: int = 0
    consumed: int = 0  # tokens of the text in the automaton

    def extend(self, token: int) -> None:
        state = len(self.length)
        self.length.append(self.length[self.last] + 1)
        self.link.append(0)
        self.end.append(self.consumed)
        self.next.append({})
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = state
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[state] = q
            else:  # q holds longer substrings too: split off the ones that also end here
                clone = len(self.length)
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.end.append(self.end[q])
                self.next.append(dict(self.next[q]))
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[state] = clone
        self.last = state
        self.consumed += 1

    def match(self) -> tuple[int, int]:
        """(length, end) of the longest suffix of the text that occurred before, and where; (0, -1)."""
        suffix = self.link[self.last]
        return (self.length[suffix], self.end[suffix]) if suffix > 0 else (0, -1)

    def propose(self, text: Sequence[int], count: int) -> list[int]:
        for token in text[self.consumed:]:
            self.extend(token)
        length, end = self.match()
        return list(text[end + 1:end + 1 + count]) if length >= self.shortest else []


@dataclass
class ContinuationDrafter:
    """Drafts a known continuation (`truth`: the prompt and its plain greedy tokens), with the draft at
    `wrong(len(text))` (None: none) replaced by another token of the `vocab`: the oracle (every draft
    accepted) and rejections placed where they are wanted, for check --speculate and the benchmark."""

    truth: list[int]
    vocab: int
    wrong: Callable[[int], int | None] = lambda n: None

    def propose(self, text: Sequence[int], count: int) -> list[int]:
        drafts = self.truth[len(text):len(text) + count]
        at = self.wrong(len(text))
        if at is not None and at < len(drafts):
            drafts[at] = (drafts[at] + 1) % self.vocab
        return drafts


NGRAM_LONGEST = 3  # prompt lookup's longest n-gram
# Drafter by name, made for a minimum match length.
DRAFTS: dict[str, Callable[[int], Drafter]] = {
    "suffix": lambda shortest: SuffixDrafter(shortest),
    "ngram": lambda shortest: NgramDrafter(max(NGRAM_LONGEST, shortest), shortest)}
DEFAULT_DRAFTS = "suffix"
DEFAULT_MIN_MATCH = 2  # docs/benchmarks.md: the measurement that chose it
