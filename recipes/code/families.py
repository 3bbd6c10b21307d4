"""Task families for the code recipe: a Python function to write, with hidden tests.

Each family turns parameters drawn from an rng into a `Spec`: the function's name and
signature, a one-paragraph docstring, a reference implementation (ours, trusted, run
in this process to compute expected outputs), and a generator of test inputs. A spec's
`key` names the family and its parameters; it decides the split and the task id.

    level  families
    1      add_k, times_k, repeat_str, first_chars, divisible
    2      fizzbuzz_one, count_char, sum_above, remove_char, rotate
    3      fizzbuzz_list, caesar, capitalize_words, running_sum, second_largest
    4      balanced, run_length, dedupe, digital_root, count_primes
    5      balanced_multi, longest_run, fizzbuzz_three, rle_decode, word_lengths
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

WORDS = ["Fizz", "Buzz", "Foo", "Bar", "Ping", "Pong", "Zip", "Zap", "Bim", "Bam"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Spec:
    key: str  # family and parameters, e.g. "fizzbuzz_one(3,5,Fizz,Buzz)"
    func: str
    signature: str  # "def f(n: int) -> str:"
    doc: str
    reference: Callable
    inputs: Callable[[random.Random], list]  # one call's positional arguments
    # What sort of case an input is (tests cover as many sorts as they can); default:
    # its expected value.
    kind: Callable | None = None


def _ints(lo, hi):
    return lambda r: [r.randint(lo, hi)]


def _word(r: random.Random, lo=3, hi=9, alphabet=LETTERS) -> str:
    return "".join(r.choice(alphabet) for _ in range(r.randint(lo, hi)))


def _text(r: random.Random, lo=2, hi=5) -> str:
    return " ".join(_word(r, 2, 7) for _ in range(r.randint(lo, hi)))


def _nums(r: random.Random, lo=0, hi=12, vlo=-20, vhi=50) -> list[int]:
    return [r.randint(vlo, vhi) for _ in range(r.randint(lo, hi))]


# level 1 ---------------------------------------------------------------------------


def add_k(r):
    k = r.randint(2, 40)
    return Spec(f"add_k({k})", f"add_{k}", f"def add_{k}(x: int) -> int:",
                f"Return x plus {k}.", lambda x: x + k, _ints(-100, 100))  # fmt: skip


def times_k(r):
    k = r.randint(2, 30)
    return Spec(f"times_k({k})", f"times_{k}", f"def times_{k}(x: int) -> int:",
                f"Return x multiplied by {k}.", lambda x: x * k, _ints(-50, 50))  # fmt: skip


def repeat_str(r):
    k = r.randint(2, 9)
    return Spec(f"repeat_str({k})", f"repeat_{k}", f"def repeat_{k}(s: str) -> str:",
                f"Return the string s repeated {k} times.", lambda s: s * k,
                lambda r: [_word(r, 0, 5)])  # fmt: skip


def first_chars(r):
    k = r.randint(1, 8)
    return Spec(f"first_chars({k})", f"first_{k}", f"def first_{k}(s: str) -> str:",
                f"Return the first {k} characters of s (all of s if it is shorter).",
                lambda s: s[:k], lambda r: [_word(r, 0, 12)])  # fmt: skip


def divisible(r):
    k = r.randint(2, 19)
    return Spec(f"divisible({k})", f"divisible_by_{k}", f"def divisible_by_{k}(n: int) -> bool:",
                f"Return True if n is divisible by {k}, else False.", lambda n: n % k == 0,
                lambda r: [r.choice([r.randint(-99, 99), k * r.randint(-9, 9)])])  # fmt: skip


# level 2 ---------------------------------------------------------------------------


def fizzbuzz_one(r):
    a, b = r.sample(range(2, 10), 2)
    w1, w2 = r.sample(WORDS, 2)

    def ref(n):
        out = (w1 if n % a == 0 else "") + (w2 if n % b == 0 else "")
        return out or str(n)

    doc = (f"Return '{w1}{w2}' if n is divisible by both {a} and {b}, '{w1}' if only by {a}, "
           f"'{w2}' if only by {b}, otherwise n as a string.")  # fmt: skip
    return Spec(f"fizzbuzz_one({a},{b},{w1},{w2})", f"{w1.lower()}{w2.lower()}",
                f"def {w1.lower()}{w2.lower()}(n: int) -> str:", doc, ref,
                lambda r: [r.choice([r.randint(1, 100), a * b * r.randint(1, 3), a * r.randint(1, 9)])])  # fmt: skip


def count_char(r):
    c = r.choice(LETTERS)
    return Spec(f"count_char({c})", f"count_{c}", f"def count_{c}(s: str) -> int:",
                f"Return how many times the letter '{c}' occurs in s.", lambda s: s.count(c),
                lambda r: [_word(r, 0, 15, c * 4 + LETTERS[:6])])  # fmt: skip


def sum_above(r):
    k = r.randint(-5, 20)
    return Spec(f"sum_above({k})", "sum_above", "def sum_above(nums: list[int]) -> int:",
                f"Return the sum of the numbers in nums that are greater than {k}.",
                lambda nums: sum(x for x in nums if x > k), lambda r: [_nums(r)])  # fmt: skip


def remove_char(r):
    c = r.choice(LETTERS)
    return Spec(f"remove_char({c})", f"remove_{c}", f"def remove_{c}(s: str) -> str:",
                f"Return s with every '{c}' removed.", lambda s: s.replace(c, ""),
                lambda r: [_word(r, 0, 12, c * 3 + LETTERS[:8])])  # fmt: skip


def rotate(r):
    k = r.randint(1, 9)
    left = r.random() < 0.5
    name = f"rotate_{'left' if left else 'right'}_{k}"

    def ref(s):
        if not s:
            return s
        m = k % len(s)
        return s[m:] + s[:m] if left else s[len(s) - m :] + s[: len(s) - m]

    side = "left: the first" if left else "right: the last"
    return Spec(f"rotate({k},{left})", name, f"def {name}(s: str) -> str:",
                f"Rotate s {side} {k} characters move to the "
                f"{'end' if left else 'front'} (rotate by {k} % len(s); '' stays '').", ref,
                lambda r: [_word(r, 0, 12)])  # fmt: skip


# level 3 ---------------------------------------------------------------------------


def fizzbuzz_list(r):
    a, b = r.sample(range(2, 8), 2)
    w1, w2 = r.sample(WORDS, 2)

    def ref(n):
        out = []
        for i in range(1, n + 1):
            w = (w1 if i % a == 0 else "") + (w2 if i % b == 0 else "")
            out.append(w or str(i))
        return out

    doc = (f"Return a list for i = 1 to n: '{w1}{w2}' when i is divisible by both {a} and "
           f"{b}, '{w1}' when only by {a}, '{w2}' when only by {b}, else str(i).")  # fmt: skip
    return Spec(f"fizzbuzz_list({a},{b},{w1},{w2})", f"{w1.lower()}_{w2.lower()}_list",
                f"def {w1.lower()}_{w2.lower()}_list(n: int) -> list[str]:", doc, ref,
                _ints(0, 30))  # fmt: skip


def caesar(r):
    k = r.randint(1, 25)

    def ref(s):
        return "".join(chr((ord(ch) - 97 + k) % 26 + 97) if "a" <= ch <= "z" else ch for ch in s)

    return Spec(f"caesar({k})", f"shift_{k}", f"def shift_{k}(s: str) -> str:",
                f"Shift every lower-case letter of s forward by {k} places in the alphabet, "
                "wrapping from 'z' to 'a'; leave other characters unchanged.", ref,
                lambda r: [_text(r, 1, 3)])  # fmt: skip


def capitalize_words(r):
    sep = r.choice([" ", "-", "_"])
    k = r.randint(1, 5)
    name = {" ": "title_words", "-": "title_dashed", "_": "title_snake"}[sep]

    def ref(s):
        return sep.join(w[:1].upper() + w[1:] if len(w) >= k else w for w in s.split(sep))

    return Spec(f"capitalize_words({sep!r},{k})", name, f"def {name}(s: str) -> str:",
                f"s holds lower-case words separated by {sep!r}. Return it with the first "
                f"letter of every word of {k} or more letters made upper-case.", ref,
                lambda r: [sep.join(_word(r, 1, 7) for _ in range(r.randint(1, 4)))])  # fmt: skip


def running_sum(r):
    start = r.randint(0, 10)

    def ref(nums):
        out, total = [], start
        for x in nums:
            total += x
            out.append(total)
        return out

    return Spec(f"running_sum({start})", "running_sum", "def running_sum(nums: list[int]) -> list[int]:",
                f"Return the running totals of nums, starting from {start}: element i is "
                f"{start} plus the sum of nums[0..i].", ref, lambda r: [_nums(r, 0, 8)])  # fmt: skip


def second_largest(r):
    which = r.choice(["largest", "smallest"])
    k = r.randint(2, 4)
    default = r.choice([None, -1, 0])
    nth = {2: "second", 3: "third", 4: "fourth"}[k]

    def ref(nums):
        distinct = sorted(set(nums), reverse=which == "largest")
        return distinct[k - 1] if len(distinct) >= k else default

    return Spec(f"kth({which},{k},{default})", f"{nth}_{which}", f"def {nth}_{which}(nums: list[int]):",
                f"Return the {nth} {which} distinct value in nums, or {default} when there are "
                f"fewer than {k} distinct values.", ref, lambda r: [_nums(r, 0, 8, -9, 9)])  # fmt: skip


# level 4 ---------------------------------------------------------------------------


def _brackets(r: random.Random, pairs: str, n: int) -> str:
    """A bracket string: balanced, left unclosed, or with one bracket changed, cut or
    swapped with its neighbour (the counts stay equal, the order breaks: ")(", "([)]",
    which a program that only counts brackets takes for balanced)."""
    opens, closes = pairs[::2], pairs[1::2]
    stack, out = [], []
    for _ in range(n):
        if stack and r.random() < 0.5:
            out.append(closes[opens.index(stack.pop())])
        else:
            o = r.choice(opens)
            stack.append(o)
            out.append(o)
    if r.random() < 0.75:  # else left unclosed
        out += [closes[opens.index(o)] for o in reversed(stack)]
    s = "".join(out)
    if r.random() < 0.5 and s:
        i, how = r.randrange(len(s)), r.random()
        if how < 0.4:
            s = s[:i] + r.choice(pairs) + s[i + 1 :]
        elif how < 0.7:
            s = s[:i] + s[i + 1 :]
        elif len(s) > 1:
            i = min(i, len(s) - 2)
            s = s[:i] + s[i + 1] + s[i] + s[i + 2 :]
    return s


def _bracket_kind(s: str, pairs: str) -> str:
    """'ok', 'unclosed', 'early_close' (a close with nothing open), 'mismatch', or
    'misordered': not balanced although every bracket kind opens as often as it closes
    (the case that tells checking the order from counting)."""
    opens, closes = pairs[::2], pairs[1::2]
    stack = []
    for ch in s:
        if ch in opens:
            stack.append(ch)
        elif ch in closes:
            early = not stack
            if early or opens[closes.index(ch)] != stack.pop():
                if all(s.count(o) == s.count(c) for o, c in zip(opens, closes)):
                    return "misordered"
                return "early_close" if early else "mismatch"
    return "unclosed" if stack else "ok"


def _balanced(s: str, pairs: str) -> bool:
    return _bracket_kind(s, pairs) == "ok"


def balanced(r):
    pair = r.choice(["()", "[]", "{}", "<>"])
    letters = r.random() < 0.5
    name = {"()": "parens", "[]": "brackets", "{}": "braces", "<>": "angles"}[pair]
    holds = "letters and" if letters else "only"
    return Spec(f"balanced({pair},{letters})", f"balanced_{name}", f"def balanced_{name}(s: str) -> bool:",
                f"s contains {holds} '{pair[0]}' and '{pair[1]}'. Return True if every "
                f"'{pair[0]}' is closed by a later '{pair[1]}' and no '{pair[1]}' comes "
                "before its match, else False.", lambda s: _balanced(s, pair),
                lambda r: [_sprinkle(r, _brackets(r, pair, r.randint(0, 8)), letters)],
                lambda s: _bracket_kind(s, pair))  # fmt: skip


def _sprinkle(r: random.Random, s: str, letters: bool) -> str:
    if not letters:
        return s
    out = list(s)
    for _ in range(r.randint(0, 4)):
        out.insert(r.randint(0, len(out)), r.choice("xyz"))
    return "".join(out)


def run_length(r):
    count_first = r.random() < 0.5
    sep = r.choice(["", "-", ","])

    def ref(s):
        out, i = [], 0
        while i < len(s):
            j = i
            while j < len(s) and s[j] == s[i]:
                j += 1
            out.append(f"{j - i}{s[i]}" if count_first else f"{s[i]}{j - i}")
            i = j
        return sep.join(out)

    ex = sep.join(["3a", "1b"] if count_first else ["a3", "b1"])
    return Spec(f"run_length({count_first},{sep!r})", "encode_runs", "def encode_runs(s: str) -> str:",
                f"Run-length encode s: each run of a repeated letter becomes "
                f"{'its length then the letter' if count_first else 'the letter then its length'}"
                f", runs joined by {sep!r}, e.g. 'aaab' -> '{ex}'.", ref, lambda r: [_word(r, 0, 10, "aaabbc")])  # fmt: skip


def dedupe(r):
    keep = r.choice(["first", "last"])
    cap = r.randint(2, 6)

    def ref(nums):
        nums = [x for x in nums if x <= cap]
        if keep == "first":
            return list(dict.fromkeys(nums))
        return list(reversed(list(dict.fromkeys(reversed(nums)))))

    return Spec(f"dedupe({keep},{cap})", f"dedupe_keep_{keep}", f"def dedupe_keep_{keep}(nums: list[int]) -> list[int]:",
                f"Return nums without values greater than {cap} and without repeated values, "
                f"keeping the {keep} occurrence of each and the order of what is kept.", ref, lambda r: [_nums(r, 0, 10, 0, 6)])  # fmt: skip


def digital_root(r):
    base = r.randint(2, 10)

    def ref(n):
        while n >= base:
            m = 0
            while n:
                m += n % base
                n //= base
            n = m
        return n

    word = "decimal" if base == 10 else f"base{base}"
    return Spec(f"digital_root({base})", f"digital_root_{word}", f"def digital_root_{word}(n: int) -> int:",
                f"n >= 0. Replace n by the sum of its base-{base} digits until it "
                "has one digit; return that digit.", ref, _ints(0, 99999))  # fmt: skip


def count_primes(r):
    strict = r.random() < 0.5
    lo = r.randint(0, 12)

    def ref(n):
        top = n - 1 if strict else n
        return sum(
            all(p % d for d in range(2, int(p**0.5) + 1)) for p in range(max(2, lo), top + 1)
        )

    rel = "less than" if strict else "less than or equal to"
    return Spec(f"count_primes({strict},{lo})", "count_primes", "def count_primes(n: int) -> int:",
                f"Return how many prime numbers p with p >= {lo} are {rel} n.", ref, _ints(0, 60))  # fmt: skip


# level 5 ---------------------------------------------------------------------------


def balanced_multi(r):
    pairs = r.choice(["()[]", "()[]{}", "(){}", "[]{}", "()<>", "()[]{}<>"])
    letters = r.random() < 0.5
    shown = " ".join(pairs[i : i + 2] for i in range(0, len(pairs), 2))
    holds = "letters and the" if letters else "only the"
    return Spec(f"balanced_multi({pairs},{letters})", "balanced", "def balanced(s: str) -> bool:",
                f"s contains {holds} brackets {shown}. Return True if every opening bracket "
                "is closed by the matching closing bracket in the right order, else False.",
                lambda s: _balanced(s, pairs),
                lambda r: [_sprinkle(r, _brackets(r, pairs, r.randint(0, 10)), letters)],
                lambda s: _bracket_kind(s, pairs))  # fmt: skip


def longest_run(r):
    what = r.choice(["equal", "increasing", "decreasing"])

    def ref(nums):
        best = cur = 0
        for i, x in enumerate(nums):
            prev = nums[i - 1] if i else None
            cont = i > 0 and {"equal": x == prev, "increasing": i and x > prev,
                              "decreasing": i and x < prev}[what]  # fmt: skip
            cur = cur + 1 if cont else 1
            best = max(best, cur)
        return best

    desc = "equal adjacent values" if what == "equal" else f"strictly {what} values"
    return Spec(f"longest_run({what})", f"longest_{what}_run", f"def longest_{what}_run(nums: list[int]) -> int:",
                f"Return the length of the longest run of {desc} in nums (0 for an empty list).",
                ref, lambda r: [_nums(r, 0, 12, 0, 4)])  # fmt: skip


def fizzbuzz_three(r):
    divs = sorted(r.sample(range(2, 8), 3))
    words = r.sample(WORDS, 3)

    def ref(n):
        return "".join(w for d, w in zip(divs, words) if n % d == 0) or str(n)

    rules = ", ".join(f"'{w}' if divisible by {d}" for d, w in zip(divs, words))
    return Spec(f"fizzbuzz_three({divs},{words})", "say", "def say(n: int) -> str:",
                f"Join, in this order, {rules}; return the joined words, or str(n) when none "
                "apply.", ref, _ints(1, 250))  # fmt: skip


def rle_decode(r):
    count_first = r.random() < 0.5
    sep = r.choice(["", ";", " "])

    def ref(s):
        s = s.replace(sep, "") if sep else s
        out, i = [], 0
        while i < len(s):
            if count_first:
                j = i
                while s[j].isdigit():
                    j += 1
                out.append(s[j] * int(s[i:j]))
                i = j + 1
            else:
                j = i + 1
                while j < len(s) and s[j].isdigit():
                    j += 1
                out.append(s[i] * int(s[i + 1 : j]))
                i = j
        return "".join(out)

    def gen(r):
        runs = [(r.choice("abcxyz"), r.randint(1, 12)) for _ in range(r.randint(0, 4))]
        return [sep.join(f"{n}{c}" if count_first else f"{c}{n}" for c, n in runs)]

    ex = sep.join(["3a", "12b"] if count_first else ["a3", "b12"])
    ex = f"{ex!r} -> 'aaa' followed by 12 'b's"
    return Spec(f"rle_decode({count_first},{sep!r})", "decode_runs", "def decode_runs(s: str) -> str:",
                f"Decode a run-length encoding where each run is written as "
                f"{'count then letter' if count_first else 'letter then count'}, runs joined by {sep!r}: {ex}.",
                ref, gen)  # fmt: skip


def word_lengths(r):
    order = r.choice(["length", "alphabet", "last_letter"])
    sep = r.choice([" ", ",", ";"])

    def ref(s):
        words = [w for w in s.split(sep) if w]
        key = {
            "length": lambda w: (len(w), w),
            "alphabet": None,
            "last_letter": lambda w: (w[-1], w),
        }
        return sorted(words, key=key[order])

    def gen(r):
        return [sep.join(_word(r, 2, 7) for _ in range(r.randint(0, 6)))]

    by = {"length": "by length, ties alphabetically", "alphabet": "alphabetically",
          "last_letter": "by their last letter, ties alphabetically"}[order]  # fmt: skip
    return Spec(f"word_lengths({order},{sep!r})", f"sort_words_by_{order}", f"def sort_words_by_{order}(s: str) -> list[str]:",
                f"Return the words of s (separated by {sep!r}) sorted {by}.", ref, gen)  # fmt: skip


LEVELS: dict[int, tuple[Callable[[random.Random], Spec], ...]] = {
    1: (add_k, times_k, repeat_str, first_chars, divisible),
    2: (fizzbuzz_one, count_char, sum_above, remove_char, rotate),
    3: (fizzbuzz_list, caesar, capitalize_words, running_sum, second_largest),
    4: (balanced, run_length, dedupe, digital_root, count_primes),
    5: (balanced_multi, longest_run, fizzbuzz_three, rle_decode, word_lengths),
}
