"""``coding``, a cooperative coding task: agent 0 writes a helper function, agent 1 the main function,
which must call it; the joint program is run against the problem's tests in a sandbox.

The problems are small string, list and number exercises, written for this project and built here in
code (no data files), so that a small model solves some of them and the reward has a gradient.
Each item also carries a reference solution (``helper_solution``, ``main_solution``) that passes its
tests; the prompts never show it.
"""

from __future__ import annotations

import ast
import re
import textwrap

from ..prompts import PromptTemplate
from .sandbox import run_python

SAMPLE_TIMEOUT = 3.0  # seconds for one joint sample's tests, interpreter start included
SPLITS = ("train", "eval")

# Reward levels; see coding_reward.
NO_CODE = 0.0
DEFINED = 0.25
USES_HELPER = 0.5
PASSED = 1.0


def _problem(problem_id: str, problem: str, helper: str, helper_description: str, main: str, main_description: str,
             tests: str) -> dict:
    """An item; names and signatures come from the reference solutions, so they cannot disagree."""
    helper, main, tests = (textwrap.dedent(text).strip() + "\n" for text in (helper, main, tests))
    item = {"id": problem_id, "problem": problem}
    for role, source, description in (("helper", helper, helper_description), ("main", main, main_description)):
        function = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef))
        item[f"{role}_name"] = function.name
        item[f"{role}_signature"] = source.splitlines()[function.lineno - 1].strip().rstrip(":")
        item[f"{role}_description"] = description
    return {**item, "tests": tests, "helper_solution": helper, "main_solution": main}


_PROBLEMS = (
    _problem(
        "vowel_heavy_words",
        "Count the words of a sentence in which vowels make up more than half of the characters.",
        r'''
        def count_vowels(word: str) -> int:
            return sum(1 for ch in word.lower() if ch in "aeiou")
        ''',
        "Return how many characters of `word` are vowels (a, e, i, o, u), ignoring case.",
        r'''
        def count_vowel_heavy_words(sentence: str) -> int:
            return sum(1 for word in sentence.split() if 2 * count_vowels(word) > len(word))
        ''',
        "Split `sentence` on whitespace and return how many words have vowels (counted with `count_vowels`) "
        "as more than half of their characters.",
        r'''
        assert count_vowel_heavy_words("") == 0
        assert count_vowel_heavy_words("area idea cat") == 2
        assert count_vowel_heavy_words("Audio is OK") == 1
        assert count_vowel_heavy_words("rhythm") == 0
        '''),
    _problem(
        "count_palindromes",
        "Count how many strings in a list are palindromes, ignoring case, spaces and punctuation.",
        r'''
        def is_palindrome(text: str) -> bool:
            cleaned = [ch.lower() for ch in text if ch.isalnum()]
            return cleaned == cleaned[::-1]
        ''',
        "Return True if `text` reads the same forwards and backwards when only its letters and digits are "
        "kept and case is ignored.",
        r'''
        def count_palindromes(words: list[str]) -> int:
            return sum(1 for word in words if is_palindrome(word))
        ''',
        "Return how many strings in `words` are palindromes according to `is_palindrome`.",
        r'''
        assert count_palindromes([]) == 0
        assert count_palindromes(["Level", "hello", "A man, a plan, a canal: Panama"]) == 2
        assert count_palindromes(["ab", "abc", "x"]) == 1
        '''),
    _problem(
        "max_digit_sum",
        "Find the number in a list whose decimal digits add up to the most.",
        r'''
        def digit_sum(n: int) -> int:
            return sum(int(d) for d in str(abs(n)))
        ''',
        "Return the sum of the decimal digits of `n`, ignoring its sign.",
        r'''
        def max_digit_sum_number(numbers: list[int]) -> int:
            best = numbers[0]
            for n in numbers:
                if digit_sum(n) > digit_sum(best):
                    best = n
            return best
        ''',
        "Return the number of the non-empty list `numbers` with the largest `digit_sum`; on a tie, the one "
        "that comes first.",
        r'''
        assert max_digit_sum_number([12, 9, 30]) == 9
        assert max_digit_sum_number([-99, 100]) == -99
        assert max_digit_sum_number([11, 20, 2]) == 11
        assert max_digit_sum_number([7]) == 7
        '''),
    _problem(
        "primes_below",
        "List the prime numbers below a limit.",
        r'''
        def is_prime(n: int) -> bool:
            if n < 2:
                return False
            d = 2
            while d * d <= n:
                if n % d == 0:
                    return False
                d += 1
            return True
        ''',
        "Return True if `n` is a prime number (numbers below 2 are not prime).",
        r'''
        def primes_below(limit: int) -> list[int]:
            return [n for n in range(limit) if is_prime(n)]
        ''',
        "Return all primes smaller than `limit` in increasing order, checking each number with `is_prime`.",
        r'''
        assert primes_below(0) == []
        assert primes_below(2) == []
        assert primes_below(3) == [2]
        assert primes_below(20) == [2, 3, 5, 7, 11, 13, 17, 19]
        '''),
    _problem(
        "title_case",
        "Capitalize every word of a sentence and normalize the spacing between words.",
        r'''
        def capitalize_word(word: str) -> str:
            return word[:1].upper() + word[1:].lower()
        ''',
        "Return `word` with its first character in upper case and the rest in lower case.",
        r'''
        def title_case(sentence: str) -> str:
            return " ".join(capitalize_word(word) for word in sentence.split())
        ''',
        "Capitalize every whitespace-separated word of `sentence` with `capitalize_word` and join the words "
        "with single spaces.",
        r'''
        assert title_case("hello world") == "Hello World"
        assert title_case("  the QUICK   fox ") == "The Quick Fox"
        assert title_case("") == ""
        assert title_case("a") == "A"
        '''),
    _problem(
        "warm_days",
        "Count the days whose Celsius temperature is above a threshold given in Fahrenheit.",
        r'''
        def to_fahrenheit(celsius: float) -> float:
            return celsius * 9 / 5 + 32
        ''',
        "Convert a temperature from degrees Celsius to degrees Fahrenheit.",
        r'''
        def count_warm_days(temperatures_c: list[float], threshold_f: float) -> int:
            return sum(1 for t in temperatures_c if to_fahrenheit(t) > threshold_f)
        ''',
        "Return how many of the Celsius temperatures are strictly above `threshold_f` once converted to "
        "Fahrenheit with `to_fahrenheit`.",
        r'''
        assert count_warm_days([], 50) == 0
        assert count_warm_days([0, 10, 20, 30], 60) == 2
        assert count_warm_days([100], 212) == 0
        assert count_warm_days([-40], -41) == 1
        '''),
    _problem(
        "lcm_of_list",
        "Compute the least common multiple of a list of positive integers.",
        r'''
        def gcd(a: int, b: int) -> int:
            while b:
                a, b = b, a % b
            return abs(a)
        ''',
        "Return the greatest common divisor of two integers (gcd(0, 0) is 0).",
        r'''
        def lcm_of_list(numbers: list[int]) -> int:
            result = 1
            for n in numbers:
                result = result * n // gcd(result, n)
            return result
        ''',
        "Return the least common multiple of the positive integers in `numbers`, using `gcd`; the least "
        "common multiple of an empty list is 1.",
        r'''
        assert lcm_of_list([]) == 1
        assert lcm_of_list([4, 6]) == 12
        assert lcm_of_list([2, 3, 5]) == 30
        assert lcm_of_list([7]) == 7
        '''),
    _problem(
        "binomial",
        "Count the ways to choose k items out of n.",
        r'''
        def factorial(n: int) -> int:
            result = 1
            for k in range(2, n + 1):
                result *= k
            return result
        ''',
        "Return n! for a non-negative integer `n` (0! is 1).",
        r'''
        def binomial(n: int, k: int) -> int:
            if k < 0 or k > n:
                return 0
            return factorial(n) // (factorial(k) * factorial(n - k))
        ''',
        "Return the number of ways to choose `k` items out of `n` as n! / (k! (n - k)!) with `factorial`; "
        "return 0 when `k` is negative or larger than `n`.",
        r'''
        assert binomial(5, 2) == 10
        assert binomial(6, 0) == 1
        assert binomial(3, 4) == 0
        assert binomial(4, -1) == 0
        assert binomial(10, 10) == 1
        '''),
    _problem(
        "most_common_char",
        "Find the character that occurs most often in a text, not counting spaces.",
        r'''
        def char_counts(text: str) -> dict[str, int]:
            counts = {}
            for ch in text:
                counts[ch] = counts.get(ch, 0) + 1
            return counts
        ''',
        "Return a dictionary mapping each character of `text` to the number of times it occurs.",
        r'''
        def most_common_char(text: str) -> str:
            counts = char_counts(text)
            best = ""
            for ch in text:
                if ch != " " and (best == "" or counts[ch] > counts[best]):
                    best = ch
            return best
        ''',
        "Return the character of `text` that occurs most often (count with `char_counts`), ignoring spaces; "
        "on a tie, the one that appears first; an empty string when there is no such character.",
        r'''
        assert most_common_char("") == ""
        assert most_common_char("   ") == ""
        assert most_common_char("banana") == "a"
        assert most_common_char("a b b a") == "a"
        assert most_common_char("xyzzy") == "y"
        '''),
    _problem(
        "anagrams_of",
        "Pick out the words of a list that are anagrams of a target word.",
        r'''
        def sorted_letters(word: str) -> str:
            return "".join(sorted(word.lower()))
        ''',
        "Return the characters of `word` in lower case, sorted, as one string.",
        r'''
        def anagrams_of(target: str, words: list[str]) -> list[str]:
            key = sorted_letters(target)
            return [word for word in words if sorted_letters(word) == key]
        ''',
        "Return, in their original order, the words whose `sorted_letters` equal those of `target` "
        "(anagrams ignoring case; the target itself counts).",
        r'''
        assert anagrams_of("listen", ["enlist", "google", "Silent", "listen"]) == ["enlist", "Silent", "listen"]
        assert anagrams_of("abc", []) == []
        assert anagrams_of("abc", ["ab", "abcc", "cab"]) == ["cab"]
        '''),
    _problem(
        "clamp_all",
        "Limit every number of a list to a range.",
        r'''
        def clamp(value: int, low: int, high: int) -> int:
            return max(low, min(value, high))
        ''',
        "Return `value` limited to the range from `low` to `high` inclusive (low <= high).",
        r'''
        def clamp_all(values: list[int], low: int, high: int) -> list[int]:
            return [clamp(value, low, high) for value in values]
        ''',
        "Return a new list with every value limited to [low, high] by `clamp`.",
        r'''
        assert clamp_all([], 0, 1) == []
        assert clamp_all([-5, 0, 5, 10, 15], 0, 10) == [0, 0, 5, 10, 10]
        assert clamp_all([3, 3], 3, 3) == [3, 3]
        '''),
    _problem(
        "run_length",
        "Run-length encode a string.",
        r'''
        def run_length(text: str, start: int) -> int:
            end = start
            while end < len(text) and text[end] == text[start]:
                end += 1
            return end - start
        ''',
        "Return the length of the run of identical characters of `text` that begins at the valid index `start`.",
        r'''
        def compress(text: str) -> str:
            parts = []
            i = 0
            while i < len(text):
                n = run_length(text, i)
                parts.append(text[i] + str(n))
                i += n
            return "".join(parts)
        ''',
        'Encode `text` so that each run of a repeated character becomes the character followed by the run\'s '
        'length (found with `run_length`), e.g. "aaab" becomes "a3b1".',
        r'''
        assert compress("") == ""
        assert compress("aaab") == "a3b1"
        assert compress("abc") == "a1b1c1"
        assert compress("zzzzzzzzzzzz") == "z12"
        '''),
    _problem(
        "days_in_years",
        "Count the days in a range of calendar years.",
        r'''
        def is_leap_year(year: int) -> bool:
            return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        ''',
        "Return True if `year` is a Gregorian leap year: divisible by 4, except centuries not divisible by 400.",
        r'''
        def days_in_years(first: int, last: int) -> int:
            return sum(366 if is_leap_year(year) else 365 for year in range(first, last + 1))
        ''',
        "Return the total number of days in the years from `first` to `last` inclusive, using `is_leap_year` "
        "(0 when `last` is before `first`).",
        r'''
        assert days_in_years(2023, 2023) == 365
        assert days_in_years(2024, 2024) == 366
        assert days_in_years(1900, 1900) == 365
        assert days_in_years(2000, 2003) == 1461
        assert days_in_years(2001, 2000) == 0
        '''),
    _problem(
        "even_fibonacci_sum",
        "Add up the even numbers among the first Fibonacci numbers.",
        r'''
        def fibonacci(n: int) -> int:
            a, b = 0, 1
            for _ in range(n):
                a, b = b, a + b
            return a
        ''',
        "Return the n-th Fibonacci number, where fibonacci(0) is 0 and fibonacci(1) is 1.",
        r'''
        def even_fibonacci_sum(count: int) -> int:
            return sum(f for f in (fibonacci(i) for i in range(count)) if f % 2 == 0)
        ''',
        "Return the sum of the even numbers among fibonacci(0), ..., fibonacci(count - 1).",
        r'''
        assert even_fibonacci_sum(0) == 0
        assert even_fibonacci_sum(4) == 2
        assert even_fibonacci_sum(10) == 44
        assert even_fibonacci_sum(13) == 188
        '''),
    _problem(
        "count_unique_words",
        "Count the different words of a text, ignoring case and surrounding punctuation.",
        r'''
        def normalize_word(word: str) -> str:
            return word.strip(".,!?;:").lower()
        ''',
        "Return `word` in lower case with the characters . , ! ? ; : removed from both of its ends.",
        r'''
        def count_unique_words(text: str) -> int:
            words = {normalize_word(word) for word in text.split()}
            words.discard("")
            return len(words)
        ''',
        "Return how many different words `text` has: split it on whitespace, compare the words after "
        "`normalize_word`, and ignore words that become empty.",
        r'''
        assert count_unique_words("") == 0
        assert count_unique_words("The cat saw the CAT.") == 3
        assert count_unique_words("Hi! hi? ... HI") == 1
        assert count_unique_words("one two three") == 3
        '''),
    _problem(
        "above_average",
        "Keep the numbers of a list that are above its average.",
        r'''
        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else 0.0
        ''',
        "Return the arithmetic mean of `values`, or 0.0 for an empty list.",
        r'''
        def above_average(values: list[float]) -> list[float]:
            average = mean(values)
            return [value for value in values if value > average]
        ''',
        "Return, in order, the values strictly greater than the `mean` of the list.",
        r'''
        assert above_average([]) == []
        assert above_average([1, 2, 3, 4]) == [3, 4]
        assert above_average([5, 5, 5]) == []
        assert above_average([10, -10, 1]) == [10, 1]
        '''),
    _problem(
        "count_ones",
        "Count the 1 bits in the binary form of each number of a list.",
        r'''
        def to_binary(n: int) -> str:
            if n == 0:
                return "0"
            digits = ""
            while n > 0:
                digits = str(n % 2) + digits
                n //= 2
            return digits
        ''',
        'Return the binary digits of the non-negative integer `n` as a string without prefix, e.g. 6 gives '
        '"110" and 0 gives "0".',
        r'''
        def count_ones(numbers: list[int]) -> list[int]:
            return [to_binary(n).count("1") for n in numbers]
        ''',
        "For each non-negative integer of `numbers`, return how many 1 digits its `to_binary` form has.",
        r'''
        assert count_ones([]) == []
        assert count_ones([0, 1, 2, 3, 7, 8]) == [0, 1, 1, 2, 3, 1]
        assert count_ones([255, 256]) == [8, 1]
        '''),
    _problem(
        "caesar",
        "Encrypt a text with a Caesar cipher.",
        r'''
        def shift_letter(ch: str, shift: int) -> str:
            if "a" <= ch <= "z":
                return chr((ord(ch) - ord("a") + shift) % 26 + ord("a"))
            if "A" <= ch <= "Z":
                return chr((ord(ch) - ord("A") + shift) % 26 + ord("A"))
            return ch
        ''',
        "Shift the ASCII letter `ch` by `shift` places in the alphabet (negative shifts go back), wrapping "
        "around and keeping its case; return any other character unchanged.",
        r'''
        def caesar(text: str, shift: int) -> str:
            return "".join(shift_letter(ch, shift) for ch in text)
        ''',
        "Apply `shift_letter` with the same `shift` to every character of `text`.",
        r'''
        assert caesar("abc", 1) == "bcd"
        assert caesar("xyz", 3) == "abc"
        assert caesar("Hello, World!", 13) == "Uryyb, Jbeyq!"
        assert caesar("abc", -1) == "zab"
        assert caesar("", 5) == ""
        '''),
    _problem(
        "remove_vowels",
        "Remove the vowels from a text.",
        r'''
        def is_vowel(ch: str) -> bool:
            return ch.lower() in ("a", "e", "i", "o", "u")
        ''',
        "Return True if the single character `ch` is a vowel (a, e, i, o, u in either case).",
        r'''
        def remove_vowels(text: str) -> str:
            return "".join(ch for ch in text if not is_vowel(ch))
        ''',
        "Return `text` without the characters for which `is_vowel` is True.",
        r'''
        assert remove_vowels("") == ""
        assert remove_vowels("Education") == "dctn"
        assert remove_vowels("rhythm") == "rhythm"
        assert remove_vowels("AEIOU aeiou!") == " !"
        '''),
    _problem(
        "length_histogram",
        "Count how many words of a text have each length.",
        r'''
        def word_lengths(text: str) -> list[int]:
            return [len(word) for word in text.split()]
        ''',
        "Return the lengths of the whitespace-separated words of `text`, in order.",
        r'''
        def length_histogram(text: str) -> dict[int, int]:
            histogram = {}
            for n in word_lengths(text):
                histogram[n] = histogram.get(n, 0) + 1
            return histogram
        ''',
        "Return a dictionary mapping each word length that occurs in `text` (from `word_lengths`) to the "
        "number of words with that length.",
        r'''
        assert length_histogram("") == {}
        assert length_histogram("a bb cc ddd") == {1: 1, 2: 2, 3: 1}
        assert length_histogram("same size word") == {4: 3}
        '''),
    _problem(
        "square_difference",
        "Subtract the sum of the squares of 1..n from the square of their sum.",
        r'''
        def square(n: int) -> int:
            return n * n
        ''',
        "Return `n` multiplied by itself.",
        r'''
        def square_difference(n: int) -> int:
            return square(sum(range(1, n + 1))) - sum(square(k) for k in range(1, n + 1))
        ''',
        "Return the square of the sum of 1, 2, ..., n minus the sum of their squares, using `square` "
        "(0 for n = 0).",
        r'''
        assert square_difference(0) == 0
        assert square_difference(1) == 0
        assert square_difference(3) == 22
        assert square_difference(10) == 2640
        '''),
    _problem(
        "count_sorted_rows",
        "Count the lists in a list of lists that are already sorted.",
        r'''
        def is_sorted(values: list[int]) -> bool:
            return all(a <= b for a, b in zip(values, values[1:]))
        ''',
        "Return True if `values` is in non-decreasing order (empty and one-element lists are sorted).",
        r'''
        def count_sorted_rows(rows: list[list[int]]) -> int:
            return sum(1 for row in rows if is_sorted(row))
        ''',
        "Return how many of the lists in `rows` are sorted according to `is_sorted`.",
        r'''
        assert count_sorted_rows([]) == 0
        assert count_sorted_rows([[1, 2, 2], [3, 1], [], [5]]) == 3
        assert count_sorted_rows([[2, 1], [9, 8, 7]]) == 0
        '''),
    _problem(
        "heaviest_row",
        "Find the row of a matrix with the largest sum.",
        r'''
        def row_sum(row: list[int]) -> int:
            total = 0
            for value in row:
                total += value
            return total
        ''',
        "Return the sum of the numbers in `row` (0 for an empty row).",
        r'''
        def heaviest_row(matrix: list[list[int]]) -> int:
            best = -1
            for i, row in enumerate(matrix):
                if best == -1 or row_sum(row) > row_sum(matrix[best]):
                    best = i
            return best
        ''',
        "Return the index of the row of `matrix` with the largest `row_sum`, the first one on a tie, or -1 "
        "for an empty matrix.",
        r'''
        assert heaviest_row([]) == -1
        assert heaviest_row([[1, 2], [5], [0, 0, 1]]) == 1
        assert heaviest_row([[3], [1, 2], [-1]]) == 0
        assert heaviest_row([[-5], [-2, -1]]) == 1
        '''),
    _problem(
        "column_sums",
        "Add up each column of a matrix.",
        r'''
        def transpose(matrix: list[list[int]]) -> list[list[int]]:
            return [list(column) for column in zip(*matrix)]
        ''',
        "Return the transpose of the rectangular `matrix` (its columns as rows); the transpose of an empty "
        "matrix is an empty list.",
        r'''
        def column_sums(matrix: list[list[int]]) -> list[int]:
            return [sum(column) for column in transpose(matrix)]
        ''',
        "Return the sum of each column of the rectangular `matrix`, left to right, using `transpose`.",
        r'''
        assert column_sums([]) == []
        assert column_sums([[1, 2, 3]]) == [1, 2, 3]
        assert column_sums([[1, 2], [3, 4], [5, 6]]) == [9, 12]
        '''),
    _problem(
        "chunk_sums",
        "Split a list into pieces of a given size and add up each piece.",
        r'''
        def chunk(values: list[int], size: int) -> list[list[int]]:
            return [values[i:i + size] for i in range(0, len(values), size)]
        ''',
        "Split `values` into consecutive pieces of length `size` (a positive integer); the last piece may be "
        "shorter.",
        r'''
        def chunk_sums(values: list[int], size: int) -> list[int]:
            return [sum(piece) for piece in chunk(values, size)]
        ''',
        "Return the sum of each piece that `chunk` splits `values` into.",
        r'''
        assert chunk_sums([], 3) == []
        assert chunk_sums([1, 2, 3, 4, 5], 2) == [3, 7, 5]
        assert chunk_sums([1, 1, 1], 5) == [3]
        assert chunk_sums([4, 5, 6], 1) == [4, 5, 6]
        '''),
    _problem(
        "split_even_odd",
        "Separate the even and the odd numbers of a list.",
        r'''
        def is_even(n: int) -> bool:
            return n % 2 == 0
        ''',
        "Return True if the integer `n` is even.",
        r'''
        def split_even_odd(numbers: list[int]) -> tuple[list[int], list[int]]:
            evens = [n for n in numbers if is_even(n)]
            odds = [n for n in numbers if not is_even(n)]
            return evens, odds
        ''',
        "Return a tuple (evens, odds) of the numbers for which `is_even` is True and False, each list in the "
        "original order.",
        r'''
        assert split_even_odd([]) == ([], [])
        assert split_even_odd([1, 2, 3, 4, -5, 0]) == ([2, 4, 0], [1, 3, -5])
        assert split_even_odd([7]) == ([], [7])
        '''),
    _problem(
        "is_balanced",
        "Check whether the parentheses in a text are balanced.",
        r'''
        def running_depth(text: str) -> list[int]:
            depths = []
            depth = 0
            for ch in text:
                if ch == "(":
                    depth += 1
                elif ch == ")":
                    depth -= 1
                depths.append(depth)
            return depths
        ''',
        "Return, for each character of `text`, the nesting depth after it: the depth starts at 0, '(' adds "
        "one, ')' subtracts one, and other characters leave it unchanged.",
        r'''
        def is_balanced(text: str) -> bool:
            depths = running_depth(text)
            return all(d >= 0 for d in depths) and (not depths or depths[-1] == 0)
        ''',
        "Return True if the depth from `running_depth` never drops below zero and ends at zero (a text "
        "without characters is balanced).",
        r'''
        assert is_balanced("") is True
        assert is_balanced("(a(b)c)") is True
        assert is_balanced("(()") is False
        assert is_balanced(")(") is False
        assert is_balanced("no brackets") is True
        '''),
    _problem(
        "armstrong_numbers",
        "List the numbers below a limit that equal the sum of their digits, each raised to the number of digits.",
        r'''
        def digits(n: int) -> list[int]:
            return [int(d) for d in str(n)]
        ''',
        "Return the decimal digits of the non-negative integer `n`, most significant first (digits(0) is [0]).",
        r'''
        def armstrong_numbers(limit: int) -> list[int]:
            result = []
            for n in range(limit):
                ds = digits(n)
                if sum(d ** len(ds) for d in ds) == n:
                    result.append(n)
            return result
        ''',
        "Return, in increasing order, the numbers n with 0 <= n < limit that equal the sum of their `digits`, "
        "each raised to the power of the number of digits.",
        r'''
        assert armstrong_numbers(0) == []
        assert armstrong_numbers(10) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        assert armstrong_numbers(500) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 153, 370, 371, 407]
        '''),
    _problem(
        "median_absolute_deviation",
        "Measure the spread of a list of numbers as the median distance from their median.",
        r'''
        def median(values: list[float]) -> float:
            ordered = sorted(values)
            middle = len(ordered) // 2
            if len(ordered) % 2:
                return ordered[middle]
            return (ordered[middle - 1] + ordered[middle]) / 2
        ''',
        "Return the median of the non-empty list `values`: the middle value once sorted, or the mean of the "
        "two middle values for an even length.",
        r'''
        def median_absolute_deviation(values: list[float]) -> float:
            center = median(values)
            return median([abs(value - center) for value in values])
        ''',
        "Return the `median` of the absolute differences between each value and the `median` of the "
        "non-empty list `values`.",
        r'''
        assert median_absolute_deviation([5]) == 0
        assert median_absolute_deviation([1, 2, 3, 4, 100]) == 1
        assert median_absolute_deviation([1, 3]) == 1
        assert median_absolute_deviation([2, 4, 6, 8]) == 2
        '''),
    _problem(
        "parse_config",
        "Read `key = value` settings from a text, skipping blank lines and comments.",
        r'''
        def parse_pair(line: str) -> tuple[str, str]:
            key, _, value = line.partition("=")
            return key.strip(), value.strip()
        ''',
        "Split `line` at its first '=' into a key and a value, both without surrounding whitespace (the value "
        "is empty when there is no '=').",
        r'''
        def parse_config(text: str) -> dict[str, str]:
            config = {}
            for line in text.splitlines():
                stripped = line.strip()
                if stripped and not stripped.startswith("#"):
                    key, value = parse_pair(stripped)
                    config[key] = value
            return config
        ''',
        "Return a dictionary of the settings in `text`, one `key=value` per line split with `parse_pair`; "
        "skip blank lines and lines whose first non-space character is '#'; a later setting of a key wins.",
        r'''
        assert parse_config("") == {}
        assert parse_config("a=1\nb = two\n") == {"a": "1", "b": "two"}
        assert parse_config("# comment\n\n  x = 1 = 2\nx=3") == {"x": "3"}
        assert parse_config("  # note\nname = Ada  ") == {"name": "Ada"}
        '''),
    _problem(
        "is_rotation",
        "Check whether one list is a rotation of another.",
        r'''
        def rotate_left(values: list[int], k: int) -> list[int]:
            if not values:
                return []
            k %= len(values)
            return values[k:] + values[:k]
        ''',
        "Return `values` rotated `k` places to the left (`k` may exceed the length); an empty list stays empty.",
        r'''
        def is_rotation(a: list[int], b: list[int]) -> bool:
            if len(a) != len(b):
                return False
            return any(rotate_left(a, k) == b for k in range(max(len(a), 1)))
        ''',
        "Return True if `b` equals `a` rotated left by some number of places (try them with `rotate_left`); "
        "lists of different lengths are never rotations of each other, and two empty lists are.",
        r'''
        assert is_rotation([], []) is True
        assert is_rotation([1, 2, 3], [2, 3, 1]) is True
        assert is_rotation([1, 2, 3], [3, 2, 1]) is False
        assert is_rotation([1, 2], [1, 2, 1]) is False
        '''),
    _problem(
        "closest_word",
        "Find the word of a list that differs from a target word in the fewest positions.",
        r'''
        def hamming(a: str, b: str) -> int:
            return sum(1 for x, y in zip(a, b) if x != y)
        ''',
        "Return the number of positions at which the equal-length strings `a` and `b` differ.",
        r'''
        def closest_word(target: str, words: list[str]) -> str:
            best = ""
            for word in words:
                if len(word) == len(target) and (best == "" or hamming(word, target) < hamming(best, target)):
                    best = word
            return best
        ''',
        "Among the words with the same length as the non-empty `target`, return the one with the smallest "
        "`hamming` distance to it (the first on a tie), or an empty string if no word has that length.",
        r'''
        assert closest_word("cat", []) == ""
        assert closest_word("cat", ["dog", "cot", "cut", "cart"]) == "cot"
        assert closest_word("abc", ["ab", "abcd"]) == ""
        assert closest_word("same", ["lame", "same"]) == "same"
        '''),
    _problem(
        "words_per_sentence",
        "Compute the average number of words per sentence of a text.",
        r'''
        def count_words(text: str) -> int:
            return len(text.split())
        ''',
        "Return the number of whitespace-separated words in `text`.",
        r'''
        def words_per_sentence(text: str) -> float:
            sentences = [s for s in text.split(".") if s.strip()]
            if not sentences:
                return 0.0
            return sum(count_words(s) for s in sentences) / len(sentences)
        ''',
        "Split `text` into sentences at every '.', ignore sentences that are empty or only whitespace, and "
        "return the mean `count_words` of the rest, or 0.0 if none is left.",
        r'''
        assert words_per_sentence("") == 0.0
        assert words_per_sentence("One two. Three four five six.") == 3.0
        assert words_per_sentence("Hi. . Go now") == 1.5
        assert words_per_sentence("...") == 0.0
        '''),
    _problem(
        "initials_count",
        "Count how many names of a list share each set of initials.",
        r'''
        def initials(name: str) -> str:
            return "".join(part[0].upper() for part in name.split())
        ''',
        'Return the upper-case first letters of the whitespace-separated parts of `name`, e.g. "ada lovelace" '
        'gives "AL".',
        r'''
        def initials_count(names: list[str]) -> dict[str, int]:
            counts = {}
            for name in names:
                key = initials(name)
                counts[key] = counts.get(key, 0) + 1
            return counts
        ''',
        "Return a dictionary mapping each result of `initials` to how many names of `names` give it.",
        r'''
        assert initials_count([]) == {}
        assert initials_count(["Ada Lovelace", "alan lee", "Grace Hopper"]) == {"AL": 2, "GH": 1}
        assert initials_count(["Plato"]) == {"P": 1}
        '''),
    _problem(
        "perfect_numbers",
        "List the perfect numbers up to a limit.",
        r'''
        def divisor_sum(n: int) -> int:
            return sum(d for d in range(1, n) if n % d == 0)
        ''',
        "Return the sum of the divisors of the positive integer `n` that are smaller than `n` (0 for n = 1).",
        r'''
        def perfect_numbers(limit: int) -> list[int]:
            return [n for n in range(1, limit + 1) if divisor_sum(n) == n]
        ''',
        "Return, in increasing order, the numbers from 1 to `limit` inclusive that equal their `divisor_sum`.",
        r'''
        assert perfect_numbers(5) == []
        assert perfect_numbers(6) == [6]
        assert perfect_numbers(500) == [6, 28, 496]
        '''),
    _problem(
        "longest_collatz",
        "Find the starting number up to a limit whose Collatz sequence takes the most steps to reach 1.",
        r'''
        def collatz_steps(n: int) -> int:
            steps = 0
            while n != 1:
                n = n // 2 if n % 2 == 0 else 3 * n + 1
                steps += 1
            return steps
        ''',
        "Return how many steps the positive integer `n` needs to reach 1 when even numbers are halved and an "
        "odd n becomes 3n + 1 (0 for n = 1).",
        r'''
        def longest_collatz(limit: int) -> int:
            best = 1
            for n in range(2, limit + 1):
                if collatz_steps(n) > collatz_steps(best):
                    best = n
            return best
        ''',
        "Return the number from 1 to `limit` (at least 1) with the most `collatz_steps`, the smallest one on "
        "a tie.",
        r'''
        assert longest_collatz(1) == 1
        assert longest_collatz(2) == 2
        assert longest_collatz(10) == 9
        assert longest_collatz(30) == 27
        '''),
    _problem(
        "next_power_of_two",
        "Round a positive integer up to a power of two.",
        r'''
        def is_power_of_two(n: int) -> bool:
            return n > 0 and n & (n - 1) == 0
        ''',
        "Return True if `n` is a power of two (1, 2, 4, 8, ...).",
        r'''
        def next_power_of_two(n: int) -> int:
            while not is_power_of_two(n):
                n += 1
            return n
        ''',
        "Return the smallest power of two that is at least the positive integer `n`, testing candidates with "
        "`is_power_of_two`.",
        r'''
        assert next_power_of_two(1) == 1
        assert next_power_of_two(5) == 8
        assert next_power_of_two(16) == 16
        assert next_power_of_two(1000) == 1024
        '''),
    _problem(
        "camel_to_snake",
        "Convert a camelCase identifier to snake_case.",
        r'''
        def split_camel(name: str) -> list[str]:
            words = []
            for ch in name:
                if ch.isupper() or not words:
                    words.append(ch)
                else:
                    words[-1] += ch
            return words
        ''',
        'Split the camelCase or PascalCase identifier `name` into words, starting a new word at every '
        'upper-case letter, e.g. "parseHttpRequest" gives ["parse", "Http", "Request"].',
        r'''
        def camel_to_snake(name: str) -> str:
            return "_".join(word.lower() for word in split_camel(name))
        ''',
        "Return the words of `split_camel` in lower case, joined by underscores.",
        r'''
        assert camel_to_snake("parseHttpRequest") == "parse_http_request"
        assert camel_to_snake("Name") == "name"
        assert camel_to_snake("x") == "x"
        assert camel_to_snake("getX") == "get_x"
        '''),
    _problem(
        "common_elements",
        "List the values two lists have in common, without repeats, in the order of the first list.",
        r'''
        def unique(values: list[int]) -> list[int]:
            seen = []
            for value in values:
                if value not in seen:
                    seen.append(value)
            return seen
        ''',
        "Return `values` without repeats, keeping the first occurrence of each value, in order.",
        r'''
        def common_elements(a: list[int], b: list[int]) -> list[int]:
            return [value for value in unique(a) if value in b]
        ''',
        "Return the values of `unique(a)` that also occur in `b`, in that order.",
        r'''
        assert common_elements([], [1]) == []
        assert common_elements([3, 1, 3, 2, 1], [1, 3, 5]) == [3, 1]
        assert common_elements([1, 2], [3, 4]) == []
        '''),
    _problem(
        "cart_total",
        "Total a shopping cart in cents when each price is taxed separately.",
        r'''
        def price_with_tax(cents: int, rate_percent: int) -> int:
            return cents + (cents * rate_percent + 50) // 100
        ''',
        "Return the price `cents` plus a tax of `rate_percent` percent, the tax rounded to the nearest whole "
        "cent with halves rounded up.",
        r'''
        def cart_total(prices_cents: list[int], rate_percent: int) -> int:
            return sum(price_with_tax(price, rate_percent) for price in prices_cents)
        ''',
        "Return the total in cents of the prices, each taxed separately with `price_with_tax`.",
        r'''
        assert cart_total([], 20) == 0
        assert cart_total([100, 250], 10) == 385
        assert cart_total([199], 5) == 209
        assert cart_total([1, 1, 1], 50) == 6
        '''),
    _problem(
        "total_duration",
        "Add up a list of durations in seconds and format the total as hours, minutes and seconds.",
        r'''
        def format_hms(seconds: int) -> str:
            hours, rest = divmod(seconds, 3600)
            minutes, secs = divmod(rest, 60)
            return f"{hours}:{minutes:02d}:{secs:02d}"
        ''',
        'Format a non-negative number of seconds as "H:MM:SS" (hours without padding, minutes and seconds '
        'with two digits), e.g. 3725 gives "1:02:05".',
        r'''
        def total_duration(durations: list[int]) -> str:
            return format_hms(sum(durations))
        ''',
        "Return the sum of the durations, in seconds, formatted by `format_hms`.",
        r'''
        assert total_duration([]) == "0:00:00"
        assert total_duration([59, 1]) == "0:01:00"
        assert total_duration([3600, 125]) == "1:02:05"
        assert total_duration([108000]) == "30:00:00"
        '''),
    _problem(
        "kind_counts",
        "Count the digits, letters and other characters of a text.",
        r'''
        def char_kind(ch: str) -> str:
            if ch.isdigit():
                return "digit"
            if ch.isalpha():
                return "letter"
            return "other"
        ''',
        'Return "digit" if the character `ch` is a digit, "letter" if it is a letter, and "other" otherwise.',
        r'''
        def kind_counts(text: str) -> dict[str, int]:
            counts = {"digit": 0, "letter": 0, "other": 0}
            for ch in text:
                counts[char_kind(ch)] += 1
            return counts
        ''',
        'Return a dictionary with the keys "digit", "letter" and "other" (all three, even when 0) counting '
        "the characters of `text` of each `char_kind`.",
        r'''
        assert kind_counts("") == {"digit": 0, "letter": 0, "other": 0}
        assert kind_counts("a1 b2!") == {"digit": 2, "letter": 2, "other": 2}
        assert kind_counts("ABC") == {"digit": 0, "letter": 3, "other": 0}
        '''),
    _problem(
        "reverse_each_word",
        "Reverse each word of a sentence while keeping the order of the words.",
        r'''
        def reverse_text(text: str) -> str:
            return text[::-1]
        ''',
        "Return `text` reversed.",
        r'''
        def reverse_each_word(sentence: str) -> str:
            return " ".join(reverse_text(word) for word in sentence.split())
        ''',
        "Reverse every whitespace-separated word of `sentence` with `reverse_text`, keep the word order, and "
        "join the words with single spaces.",
        r'''
        assert reverse_each_word("") == ""
        assert reverse_each_word("hello world") == "olleh dlrow"
        assert reverse_each_word("  a  bc ") == "a cb"
        '''),
    _problem(
        "first_index_reaching",
        "Find where the running total of a list first reaches a target.",
        r'''
        def running_totals(values: list[int]) -> list[int]:
            totals = []
            total = 0
            for value in values:
                total += value
                totals.append(total)
            return totals
        ''',
        "Return the running totals of `values`: element i is the sum of values[0] through values[i].",
        r'''
        def first_index_reaching(values: list[int], target: int) -> int:
            for i, total in enumerate(running_totals(values)):
                if total >= target:
                    return i
            return -1
        ''',
        "Return the first index at which the `running_totals` of `values` is at least `target`, or -1 if it "
        "never is.",
        r'''
        assert first_index_reaching([], 1) == -1
        assert first_index_reaching([1, 2, 3, 4], 6) == 2
        assert first_index_reaching([5, -10, 20], 5) == 0
        assert first_index_reaching([1, 1], 3) == -1
        '''),
    _problem(
        "nearest_point",
        "Find the point of a list nearest to an origin in Manhattan distance.",
        r'''
        def manhattan(p: tuple[int, int], q: tuple[int, int]) -> int:
            return abs(p[0] - q[0]) + abs(p[1] - q[1])
        ''',
        "Return the Manhattan distance |x1 - x2| + |y1 - y2| between the points `p` = (x1, y1) and "
        "`q` = (x2, y2).",
        r'''
        def nearest_point(origin: tuple[int, int], points: list[tuple[int, int]]) -> int:
            best = -1
            for i, point in enumerate(points):
                if best == -1 or manhattan(origin, point) < manhattan(origin, points[best]):
                    best = i
            return best
        ''',
        "Return the index of the point of `points` with the smallest `manhattan` distance to `origin` (the "
        "first one on a tie), or -1 if `points` is empty.",
        r'''
        assert nearest_point((0, 0), []) == -1
        assert nearest_point((0, 0), [(3, 4), (1, 1), (-1, 1)]) == 1
        assert nearest_point((5, 5), [(5, 6), (6, 5)]) == 0
        assert nearest_point((2, -3), [(10, 10), (2, -3)]) == 1
        '''),
    _problem(
        "best_word",
        "Find the word whose letters score the most when a is 1, b is 2, ..., z is 26.",
        r'''
        def letter_value(ch: str) -> int:
            if ch.isascii() and ch.isalpha():
                return ord(ch.lower()) - ord("a") + 1
            return 0
        ''',
        "Return the alphabet position of the ASCII letter `ch` ignoring case (a is 1, z is 26), or 0 for any "
        "other character.",
        r'''
        def best_word(words: list[str]) -> str:
            best, best_score = "", -1
            for word in words:
                score = sum(letter_value(ch) for ch in word)
                if score > best_score:
                    best, best_score = word, score
            return best
        ''',
        "Return the word whose characters' `letter_value`s add up to the most (the first one on a tie), or an "
        "empty string for an empty list.",
        r'''
        assert best_word([]) == ""
        assert best_word(["abc", "z", "bb"]) == "z"
        assert best_word(["ad", "cb", "A-D"]) == "ad"
        assert best_word(["", "!"]) == ""
        '''),
    _problem(
        "count_triangles",
        "Count the side-length triples that can form a triangle.",
        r'''
        def is_triangle(a: int, b: int, c: int) -> bool:
            return a > 0 and b > 0 and c > 0 and a + b > c and a + c > b and b + c > a
        ''',
        "Return True if the side lengths `a`, `b`, `c` are all positive and each is shorter than the sum of "
        "the other two.",
        r'''
        def count_triangles(triples: list[tuple[int, int, int]]) -> int:
            return sum(1 for a, b, c in triples if is_triangle(a, b, c))
        ''',
        "Return how many of the (a, b, c) triples pass `is_triangle`.",
        r'''
        assert count_triangles([]) == 0
        assert count_triangles([(3, 4, 5), (1, 2, 3), (2, 2, 2)]) == 2
        assert count_triangles([(0, 1, 1), (-1, 2, 2), (10, 1, 1)]) == 0
        '''),
    _problem(
        "count_number_palindromes",
        "Count the numbers of a list that read the same with their digits reversed.",
        r'''
        def reverse_number(n: int) -> int:
            return int(str(n)[::-1])
        ''',
        "Return the non-negative integer `n` with its decimal digits reversed; leading zeros disappear, e.g. "
        "120 gives 21.",
        r'''
        def count_number_palindromes(numbers: list[int]) -> int:
            return sum(1 for n in numbers if reverse_number(n) == n)
        ''',
        "Return how many of the non-negative integers in `numbers` equal their `reverse_number`.",
        r'''
        assert count_number_palindromes([]) == 0
        assert count_number_palindromes([0, 7, 11, 12, 121, 120]) == 4
        assert count_number_palindromes([10, 100]) == 0
        '''),
)


def coding_dataset(split: str = "train") -> list[dict]:
    """The shipped problems of ``split``: every fifth one is held out for "eval" (a fixed ~80/20 split).

    Each item has ``id``, ``problem``, ``helper_name``/``helper_signature``/``helper_description``, the same
    for ``main``, ``tests`` (assert statements calling the main function) and the reference solutions
    ``helper_solution`` and ``main_solution``. The items are fresh copies.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: the coding task has the splits 'train' and 'eval'.")
    held_out = split == "eval"
    return [dict(item) for i, item in enumerate(_PROBLEMS) if (i % 5 == 4) == held_out]


_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str, name: str | None = None) -> str:
    """The code of a completion: the first fenced block (```python ... ```, closed or not) that defines
    ``name``, else the first block, else the whole text."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion.strip()
    if name is not None:
        for block in blocks:
            if re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", block, re.MULTILINE):
                return block.strip()
    return blocks[0].strip()


def _parse(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: NUL bytes
        return None


def _defines(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    """The top-level ``def name`` of a module, if any."""
    return next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name), None)


def _binds(tree: ast.AST, name: str) -> bool:
    """Whether code anywhere in ``tree`` binds ``name`` (a def, class, assignment, parameter or import)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, ast.arg) and node.arg == name:
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.partition(".")[0]) == name:
            return True
    return False


def _uses(function: ast.FunctionDef, name: str) -> bool:
    """Whether ``function`` refers to ``name``: calls it, or passes it on (e.g. to ``map``)."""
    return any(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)
               for node in ast.walk(function))


def coding_reward(helpers: list[str], mains: list[str], *, batch_items: list[dict],
                  timeout: float = SAMPLE_TIMEOUT) -> list[float]:
    """One reward per joint sample (agent 0's helper, agent 1's main) for the problem ``batch_items[0]``.

    The code of each completion is taken from its markdown fence if it has one. Levels:

    * 0.0  (``NO_CODE``): a completion does not parse, or does not define its function at top level.
    * 0.25 (``DEFINED``): both parse and define ``helper_name`` and ``main_name``, but the main function
      does not use the helper, or the main completion defines (shadows) the helper itself.
    * 0.5  (``USES_HELPER``): ... and the main function calls (or passes on) agent 0's helper, but the
      joint program ``helper + main + tests`` fails in the sandbox: a failed assert, an error, or an exit
      before the tests finished. A program that times out or tries what the sandbox refuses (network,
      writes outside its directory, spawning processes) gets 0.0.
    * 1.0  (``PASSED``): ... and every test passes.

    Each joint sample runs in one sandboxed subprocess for at most ``timeout`` seconds. The sandbox is
    not a proof against adversarial code: e.g. an object whose ``__eq__`` always returns True passes
    ``==`` asserts.
    """
    if len(helpers) != len(mains):
        raise ValueError(f"got {len(helpers)} helper completions but {len(mains)} main completions; "
                         "the two agents give one completion per joint sample each.")
    if not batch_items or not isinstance(batch_items[0], dict):
        raise ValueError("coding_reward needs batch_items=[item], the problem's dataset item (a dict).")
    item = batch_items[0]
    missing = [key for key in ("helper_name", "main_name", "tests") if key not in item]
    if missing:
        raise ValueError(f"the item lacks {missing}; coding_reward needs items from coding_dataset.")
    scores: dict[tuple[str, str], float] = {}  # the same joint sample twice runs once
    rewards = []
    for helper_text, main_text in zip(helpers, mains):
        helper = extract_code(helper_text, item["helper_name"])
        main = extract_code(main_text, item["main_name"])
        if (helper, main) not in scores:
            scores[helper, main] = _score(helper, main, item, timeout)
        rewards.append(scores[helper, main])
    return rewards


def _score(helper: str, main: str, item: dict, timeout: float) -> float:
    helper_tree, main_tree = _parse(helper), _parse(main)
    if helper_tree is None or main_tree is None:
        return NO_CODE
    main_function = _defines(main_tree, item["main_name"])
    if _defines(helper_tree, item["helper_name"]) is None or main_function is None:
        return NO_CODE
    if not _uses(main_function, item["helper_name"]) or _binds(main_tree, item["helper_name"]):
        return DEFINED
    result = run_python(f"{helper}\n\n\n{main}\n\n\n{item['tests']}", timeout=timeout)
    if result.passed:
        return PASSED
    # Hanging, or trying what the sandbox refuses, earns nothing: never more than an honest failure.
    return NO_CODE if result.timed_out or result.refused else USES_HELPER


_SYSTEM = ("You are an expert Python programmer on a team of two. Reply with one Python code block and "
           "nothing else: no explanations, no tests, no example usage.")

CODING_PROMPTS = (
    PromptTemplate(
        system=_SYSTEM,
        user="Your team is solving this problem: {problem}\n\n"
             "Your part is the helper function:\n{helper_signature}\n{helper_description}\n\n"
             "A teammate writes the main function, which will call `{helper_name}`. Write only `{helper_name}` "
             "(with any imports it needs), using exactly this signature.",
    ),
    PromptTemplate(
        system=_SYSTEM,
        user="Your team is solving this problem: {problem}\n\n"
             "A teammate writes this helper function; do not write it yourself, just call it:\n"
             "{helper_signature}\n{helper_description}\n\n"
             "Your part is the main function:\n{main_signature}\n{main_description}\n\n"
             "Write only `{main_name}` (with any imports it needs), using exactly this signature; it must call "
             "`{helper_name}`.",
    ),
)
