"""The built-in prompt set (`eyas data prepare --input builtin`): about 1,300 varied,
prompt-only conversations generated deterministically from the templates and topics in
this file (no data files, no randomness beyond a fixed seed). Categories: code, math,
explanation, writing, qa, and multi-turn chat (two user turns). They carry no answers,
so they are meant for `--regenerate` (the target writes the responses).

`PUBLIC` (`--input builtin-public`) is the other built-in set: 2,474 real prompts from
public MIT / Apache-2.0 datasets, shipped as data (eyas/data/PUBLIC_PROMPTS.md says where
each comes from; bench/build_public_prompts.py rebuilds the file).
"""

from __future__ import annotations

import random
from pathlib import Path

from eyas.formats.prompt_records import Conversation

SOURCE = "builtin"
PUBLIC = Path(__file__).parent.parent / "data" / "public_prompts.jsonl.gz"
SEED = 1234

LANGUAGES = ("Python", "JavaScript", "Ruby", "C++", "Rust", "Go", "Java", "TypeScript", "Bash", "SQL")
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "computes the n-th Fibonacci number",
    "removes duplicates from a list while keeping order", "counts the words in a text",
    "merges two sorted lists", "finds the largest element of an array", "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome", "computes the factorial of n", "sorts a list with bubble sort",
    "parses a CSV line into fields", "returns the greatest common divisor of two integers",
    "flattens a nested list", "counts vowels in a string", "implements binary search",
    "reads a file and prints its number of lines", "validates an email address",
    "computes the average of a list of numbers", "transposes a matrix",
)
CODE_TEMPLATES = (
    "Write a {lang} function that {task}.",
    "In {lang}, how would you write code that {task}? Include a short example.",
    "Show me idiomatic {lang} code that {task}, and explain it briefly.",
)
CODE_REVIEW = (
    "What is the difference between a list and a tuple in Python?",
    "Explain what a race condition is and how to avoid one.",
    "What does `git rebase` do, and when should I use it instead of `git merge`?",
    "Why is recursion sometimes slower than iteration?",
    "Explain Big-O notation with three examples.",
    "What is a hash table and why are lookups fast on average?",
    "How does garbage collection work in Java?",
    "What is the difference between a process and a thread?",
    "Explain what an API is to a beginner programmer.",
    "What are unit tests and why do developers write them?",
)

MATH_NAMES = ("Alice", "Ben", "Chen", "Dara", "Emil", "Fatima", "Gus", "Hana", "Ivan", "Julia", "Kofi", "Lena")
MATH_ITEMS = ("apples", "books", "stickers", "marbles", "pencils", "cookies", "stamps", "coins")
MATH_TEMPLATES = (
    "{name} has {a} {item}. {name} buys {b} more and then gives away {c}. How many {item} does {name} have now?",
    "A box holds {a} {item}. How many {item} are there in {b} boxes?",
    "{name} shares {p} {item} equally among {b} friends. How many {item} does each friend get, and how many are "
    "left over?",
    "{name} reads {a} pages a day. How many days does it take to read a book of {p} pages?",
    "A shirt costs ${a}. It is on sale for {c}% off. What is the sale price?",
    "A train travels {p} km in {b} hours. What is its average speed?",
    "{name} saves ${a} every week. How many weeks until {name} has ${p}?",
    "What is {a} multiplied by {b}, minus {c}? Show your steps.",
)
MATH_CONCEPTS = (
    "Solve for x: 3x + 7 = 22.", "What is the derivative of x^3 + 2x?", "What is 15% of 240?",
    "Find the area of a circle with radius 5.", "Simplify the fraction 84/126.",
    "What is the sum of the interior angles of a hexagon?", "Solve the system: x + y = 10, x - y = 4.",
    "What is the probability of rolling two sixes with two dice?", "Convert 0.375 to a fraction.",
    "What is the least common multiple of 12 and 18?",
)

CONCEPTS = (
    "photosynthesis", "inflation", "black holes", "the water cycle", "machine learning", "vaccines",
    "compound interest", "plate tectonics", "the greenhouse effect", "supply and demand", "DNA replication",
    "the internet", "electric cars", "the immune system", "blockchain", "gravity", "climate change",
    "neural networks", "the stock market", "antibiotics", "solar panels", "encryption", "evolution",
    "the French Revolution", "democracy", "quantum computing", "tides", "rainbows", "earthquakes", "sleep",
)
EXPLAIN_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Explain {topic} to a ten-year-old.",
    "What are the main causes and effects of {topic}?",
    "Give me three surprising facts about {topic}.",
    "What are common misconceptions about {topic}?",
    "Summarize what a student should know about {topic} in one paragraph.",
)

WRITING_FORMS = (
    "a short poem", "a haiku", "a product description", "a short story opening", "a formal email",
    "a motivational speech", "a limerick", "a blog post introduction", "a thank-you note", "a news headline and lede",
)
WRITING_SUBJECTS = (
    "a rainy Monday morning", "a robot learning to paint", "a new coffee shop", "the first day of school",
    "a lost cat returning home", "a trip to the mountains", "a team winning a championship",
    "a library at midnight", "a city in the year 2100", "an old lighthouse keeper", "a garden in spring",
    "a friendly dragon",
)

QA_SUBJECTS = ("France", "Japan", "Brazil", "Egypt", "Canada", "India", "Kenya", "Australia", "Mexico", "Norway")
QA_TEMPLATES = (
    "What is the capital of {x}, and what is it known for?",
    "What languages are spoken in {x}?",
    "Describe the climate of {x}.",
    "What are three famous dishes from {x}?",
    "What is one important event in the history of {x}?",
)
QA_GENERAL = (
    "Who wrote Pride and Prejudice?", "How far is the Moon from the Earth?",
    "What is the boiling point of water at sea level?",
    "How many bones are in the adult human body?", "What is the largest planet in the solar system?",
    "Who painted the Mona Lisa?", "What is the speed of light?", "Why is the sky blue?",
    "What is the tallest mountain on Earth?", "How do bees make honey?",
)

FOLLOW_UPS = (
    "Can you make that shorter?", "Now give me an example.", "Can you explain it more simply?",
    "What would be a good next step?", "Summarize your answer in one sentence.",
    "Can you turn that into a bulleted list?", "What is the most important point?",
)


def _conv(i: int, category: str, *user_turns: str) -> Conversation:
    return Conversation(id=f"{SOURCE}:{i}", source=SOURCE, category=category,
                        turns=[{"role": "user", "content": t} for t in user_turns])


def _math_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for k in range(n):
        a, b = rng.randint(3, 60), rng.randint(2, 12)
        c = rng.randint(1, min(30, a + b))
        out.append(MATH_TEMPLATES[k % len(MATH_TEMPLATES)].format(
            name=rng.choice(MATH_NAMES), item=rng.choice(MATH_ITEMS), a=a, b=b, c=c, p=a * b + c))
    return out


def builtin_prompts() -> list[Conversation]:
    """The built-in set, always the same list in the same order."""
    rng = random.Random(SEED)
    items: list[tuple[str, tuple[str, ...]]] = []
    items += [("code", (t.format(lang=lang, task=task),))
              for task in CODE_TASKS for lang in LANGUAGES for t in CODE_TEMPLATES[:2]]
    items += [("code", (CODE_TEMPLATES[2].format(lang=lang, task=task),))
              for task in CODE_TASKS[:10] for lang in LANGUAGES[:5]]
    items += [("code", (q,)) for q in CODE_REVIEW]
    items += [("math", (q,)) for q in _math_prompts(rng, 240)] + [("math", (q,)) for q in MATH_CONCEPTS]
    items += [("explanation", (t.format(topic=x),)) for x in CONCEPTS for t in EXPLAIN_TEMPLATES]
    items += [("writing", (f"Write {form} about {subj}.",)) for form in WRITING_FORMS for subj in WRITING_SUBJECTS]
    items += [("qa", (t.format(x=x),)) for x in QA_SUBJECTS for t in QA_TEMPLATES] + [("qa", (q,)) for q in QA_GENERAL]
    for k, x in enumerate(CONCEPTS + tuple(f"{subj}" for subj in WRITING_SUBJECTS)):
        first = f"Tell me about {x}." if k < len(CONCEPTS) else f"Write a short paragraph about {x}."
        items.append(("chat", (first, FOLLOW_UPS[k % len(FOLLOW_UPS)])))
        items.append(("chat", (EXPLAIN_TEMPLATES[k % 4].format(topic=x), FOLLOW_UPS[(k + 3) % len(FOLLOW_UPS)])))
    # Interleave categories so that --limit N keeps a mix.
    rng.shuffle(items)
    return [_conv(i, cat, *turns) for i, (cat, turns) in enumerate(items)]
