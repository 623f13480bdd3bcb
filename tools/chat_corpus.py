"""The synthetic conversations the embedded model learns chat and tool calling from, made from
its reference text (Python's `pydoc_data.topics`) and small word lists, reproducibly from a seed.

Each `Dialogue` is OpenAI-shaped data (messages, tools) that the chat template renders; what
the model is trained to write is the assistant turns. Kinds:
- questions about a section of the reference text, answered with its first sentences;
- greetings, and "repeat after me" (the copying that tool calls need);
- tool calls: one to three tools with schemas in the shapes clients send (OpenAI's examples,
  pydantic's / the Agents SDK's, LangChain's), a question naming one tool's subject with its
  arguments' values in it, the call, the tool's result, and an answer quoting the result.

`split` keeps held-out dialogues apart: the evaluation draws values (cities, names, words)
the training dialogues never contain, so a right call means copying, not recall.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

CITIES = (  # noqa: SIM905 -- a word list reads best as words
    "Paris Oslo Lima Tokyo Berlin Madrid Rome Cairo Delhi Sydney Toronto Chicago Boston Denver "
    "Dublin Vienna Prague Warsaw Athens Lisbon Zurich Geneva Munich Hamburg Milan Naples Seoul "
    "Beijing Shanghai Mumbai Nairobi Lagos Accra Dakar Tunis Algiers Rabat Lyon Nice Bordeaux "
    "Seville Valencia Porto Bergen Stockholm Helsinki Copenhagen Riga Tallinn Vilnius Minsk "
    "Kyiv Odessa Istanbul Ankara Tehran Baghdad Riyadh Dubai Doha Karachi Lahore Dhaka Bangkok "
    "Hanoi Manila Jakarta Singapore Perth Auckland Wellington Santiago Quito Bogota Caracas "
    "Havana Montreal Vancouver Seattle Portland Austin Dallas Houston Miami Atlanta Phoenix "
    "Calgary Glasgow Edinburgh Cardiff Belfast Leeds Bristol Oxford Cambridge Kyoto Osaka Busan "
    "Taipei Manchester Liverpool Antwerp Brussels Amsterdam Rotterdam Utrecht Basel Bern Turin "
    "Florence Venice Bologna Krakow Gdansk Budapest Bucharest Sofia Belgrade Zagreb Split "
    "Ljubljana"
).split()
CITIES += ["New York", "San Francisco", "Los Angeles", "Hong Kong", "Cape Town", "Buenos Aires",
           "Mexico City", "Rio de Janeiro", "Sao Paulo", "Tel Aviv"]  # fmt: skip
NAMES = (  # noqa: SIM905 -- a word list reads best as words
    "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Rupert Sybil "
    "Trent Victor Walter Ada Alan Grace Linus Guido Barbara Donald Edsger Niklaus Tim Ken "
    "Dennis Bjarne James Anders Larry Rasmus Yukihiro Brendan John Margaret Hedy Katherine "
    "Dorothy Mary Annie Frances Jean Radia Sophie Lena Maya Noah Liam Emma Olivia Lucas Mia"
).split()
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowing", "clear", "stormy")
LANGUAGES = ("French", "German", "Spanish", "Italian", "Dutch", "Polish", "Greek", "Swedish")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Use the tools when they help.",
    "Answer briefly.",
    "You are octavo-tiny, a small model that knows Python's reference manual.",
    "Use the tools to answer the user's questions.",
    "You are an agent. Call a tool when you need one, then answer.",
    "You help with questions about Python.",
)
GREETINGS = ("Hi", "Hello", "Hello!", "Hi there", "Hey", "Good morning", "Who are you?",
             "What can you do?", "Thanks", "Thank you!")  # fmt: skip
GREETING_ANSWERS = (
    "Hello! I am octavo-tiny, a small model trained on Python's reference manual. "
    "Ask me about Python, or give me tools to call.",
    "Hi! I can answer questions about Python and call the tools you give me.",
    "You are welcome. Ask me anything about Python.",
)


@dataclass
class Dialogue:
    """A conversation in OpenAI's shapes; `tools` as chat completions' `tools`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    # The text the last answer must quote (a tool's result, a repeated phrase), for the
    # held-out evaluation; the expected call is the assistant turn's own `tool_calls`.
    quote: str | None = None


def reference_sections(texts: list[str]) -> list[tuple[str, str]]:
    """(heading, first sentences) of every section of the reference text: a heading is a
    line underlined with = - * ~ or ^; its answer is the section's first prose paragraph,
    cut to at most two sentences."""
    sections = []
    for text in texts:
        parts = re.split(r"\n([^\n]+)\n([=\-*~^])\2{3,}\n", "\n" + text)
        # parts: [before, heading, underline char, body, heading, char, body, ...]
        for i in range(1, len(parts) - 2, 3):
            heading, body = parts[i].strip(), parts[i + 2]
            paragraph = next(
                (
                    p
                    for p in body.split("\n\n")
                    if len(p) > 40 and not p.startswith(" ") and "::=" not in p
                ),
                None,
            )
            if paragraph is None:
                continue
            prose = " ".join(paragraph.split())
            sentences = re.split(r"(?<=[.!?:])\s+", prose)
            answer = " ".join(sentences[:2])[:400]
            heading = heading.replace('"', "")
            if heading.startswith("The "):
                heading = "the" + heading[3:]
            sections.append((heading, answer))
    return sections


def words(texts: list[str]) -> list[str]:
    """The reference text's plain lowercase words of 4-10 letters, deduplicated, in order."""
    seen: dict[str, None] = {}
    for text in texts:
        for word in re.findall(r"\b[a-z]{4,10}\b", text):
            seen.setdefault(word)
    return list(seen)


@dataclass(frozen=True)
class ToolKind:
    """A family of tools: names, a description, parameters as (name, JSON type, values),
    questions with the values in them, results and answers quoting them."""

    names: tuple[str, ...]
    description: tuple[str, ...]
    subject: str
    parameters: tuple[tuple[str, str], ...]
    questions: tuple[str, ...]
    answers: tuple[str, ...]


TOOL_KINDS = (
    ToolKind(
        (
            "get_weather",
            "get_current_weather",
            "weather",
            "GetWeather",
            "fetch_weather",
            "get_forecast",
            "current_weather",
        ),
        (
            "Returns the weather in a city.",
            "Get the current weather for a location.",
            "The forecast for a city.",
            "Look up the weather.",
        ),
        "weather",
        (("city", "city"),),
        (
            "What is the weather in {city}?",
            "How is the weather in {city} today?",
            "Weather in {city}?",
            "What's the weather like in {city}?",
            "Is it raining in {city}?",
            "Tell me the weather in {city}.",
            "Can you check the weather in {city}?",
            "What is the forecast for {city}?",
        ),
        (
            "The weather in {city} is {result}.",
            "{result}",
            "It is {result} in {city}.",
            "In {city}: {result}.",
        ),
    ),
    ToolKind(
        ("get_time", "get_current_time", "current_time", "GetTime", "local_time"),
        ("Returns the local time in a city.", "Get the current time for a location."),
        "time",
        (("city", "city"),),
        (
            "What time is it in {city}?",
            "What is the time in {city}?",
            "Time in {city}?",
            "Tell me the local time in {city}.",
        ),
        ("The time in {city} is {result}.", "It is {result} in {city}.", "{result}"),
    ),
    ToolKind(
        ("add", "add_numbers", "sum_numbers", "Add", "plus"),
        ("Add two numbers.", "The sum of two numbers.", "Returns a plus b."),
        "sum",
        (("a", "int"), ("b", "int")),
        (
            "What is {a} plus {b}?",
            "Add {a} and {b}.",
            "What is {a} + {b}?",
            "Compute the sum of {a} and {b}.",
            "What do {a} and {b} add up to?",
        ),
        (
            "{a} plus {b} is {result}.",
            "The sum is {result}.",
            "{result}",
            "The answer is {result}.",
        ),
    ),
    ToolKind(
        ("multiply", "multiply_numbers", "Multiply", "times", "product"),
        ("Multiply two numbers.", "Multiply a and b.", "The product of two numbers."),
        "product",
        (("a", "int"), ("b", "int")),
        (
            "What is {a} times {b}?",
            "Multiply {a} by {b}.",
            "What is {a} * {b}?",
            "Compute the product of {a} and {b}.",
        ),
        ("{a} times {b} is {result}.", "The product is {result}.", "{result}"),
    ),
    ToolKind(
        ("lookup_docs", "search_docs", "python_docs", "SearchDocs", "read_docs", "docs"),
        (
            "Search Python's documentation.",
            "Look up a topic in the Python reference.",
            "Returns what the docs say about a topic.",
        ),
        "documentation",
        (("topic", "topic"),),
        (
            "What do the docs say about {topic}?",
            "Look up {topic} in the docs.",
            "Search the documentation for {topic}.",
            "Find {topic} in the Python docs.",
        ),
        ("The documentation says: {result}", "{result}", "According to the docs, {result}"),
    ),
    ToolKind(
        ("get_stock_price", "stock_price", "GetStockPrice", "get_quote"),
        ("Returns the stock price of a company.", "Get the latest price for a ticker symbol."),
        "price",
        (("symbol", "symbol"),),
        (
            "What is the stock price of {symbol}?",
            "How much is {symbol} trading at?",
            "Get the price of {symbol}.",
            "What is {symbol} worth today?",
        ),
        ("{symbol} is trading at {result}.", "The price of {symbol} is {result}.", "{result}"),
    ),
    ToolKind(
        ("get_order_status", "order_status", "track_order", "GetOrderStatus"),
        ("Returns the status of an order.", "Track an order by its id."),
        "order",
        (("order_id", "order"),),
        (
            "Where is my order {order_id}?",
            "What is the status of order {order_id}?",
            "Track order {order_id}.",
            "Has order {order_id} shipped?",
        ),
        ("Order {order_id} is {result}.", "Your order is {result}.", "{result}"),
    ),
    ToolKind(
        ("get_user", "lookup_user", "find_user", "GetUser", "user_info"),
        ("Returns a user's profile.", "Look up a user by name."),
        "user",
        (("name", "name"),),
        (
            "Who is {name}?",
            "Look up the user {name}.",
            "Find the user called {name}.",
            "What do you know about the user {name}?",
        ),
        ("{name}: {result}", "The user {name} is {result}.", "{result}"),
    ),
    ToolKind(
        ("translate", "translate_text", "Translate"),
        ("Translate a word into a language.", "Translates text."),
        "translation",
        (("text", "word"), ("language", "language")),
        (
            "Translate {text} into {language}.",
            "How do you say {text} in {language}?",
            "What is {text} in {language}?",
        ),
        ("In {language}, {text} is {result}.", "{result}", "The translation is {result}."),
    ),
    ToolKind(
        ("count_letters", "word_length", "CountLetters"),
        ("Counts the letters of a word.", "Returns the length of a word."),
        "letters",
        (("word", "word"),),
        (
            "How many letters are in {word}?",
            "Count the letters of {word}.",
            "How long is the word {word}?",
        ),
        ("{word} has {result} letters.", "{result}", "The word {word} has {result} letters."),
    ),
)
JSON_TYPES = {"int": "integer"}


class DialogueMaker:
    """Draws dialogues; `held_out` draws values from the other side of each pool's split."""

    def __init__(self, texts: list[str], seed: int, held_out: bool = False):
        self.rng = random.Random(seed)
        self.sections = reference_sections(texts)
        pools = {
            "city": CITIES,
            "name": NAMES,
            "word": words(texts),
            "topic": [heading for heading, _ in self.sections],
        }
        # Every fifth value is held out: training never sees it in a tool dialogue.
        self.pools = {
            kind: [v for i, v in enumerate(values) if (i % 5 == 4) == held_out]
            for kind, values in pools.items()
        }
        self.answers = dict(self.sections)
        self.vocabulary = words(texts)

    def dialogue(self) -> Dialogue:
        roll = self.rng.random()
        if roll < 0.55:
            return self.tool_dialogue()
        if roll < 0.75:
            return self.section_question()
        if roll < 0.92:
            return self.repeat()
        return self.greeting()

    # -- turns ------------------------------------------------------------------------------

    def _system(self, messages: list[dict[str, Any]]) -> None:
        if self.rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)})

    def _history(self) -> list[dict[str, Any]]:
        """Sometimes an earlier exchange comes first."""
        if self.rng.random() < 0.75:
            return []
        heading, answer = self.rng.choice(self.sections)
        return [
            {"role": "user", "content": f"What is {heading}?"},
            {"role": "assistant", "content": answer},
        ]

    def section_question(self, tools: list[dict[str, Any]] | None = None) -> Dialogue:
        heading, answer = self.rng.choice(self.sections)
        question = self.rng.choice(
            ("What is {h}?", "Tell me about {h}.", "Explain {h}.", "What does Python say about "
             "{h}?", "{h}?", "Describe {h}.", "What do you know about {h}?")
        ).format(h=heading)  # fmt: skip
        messages = [*self._history(), {"role": "user", "content": question}]
        messages.append({"role": "assistant", "content": answer})
        self._system(messages)
        return Dialogue(messages, tools or [])

    def repeat(self) -> Dialogue:
        """Copying in its plainest form: words, names, numbers and codes said back."""
        text = " ".join(self._copyable() for _ in range(self.rng.randint(1, 24)))
        question = self.rng.choice(("Repeat after me: {t}", "Say {t}", "Echo this: {t}",
                                    "Please repeat: {t}"))  # fmt: skip
        messages = [{"role": "user", "content": question.format(t=text)}]
        messages.append({"role": "assistant", "content": text})
        self._system(messages)
        return Dialogue(messages, quote=text)

    def _copyable(self) -> str:
        roll = self.rng.random()
        if roll < 0.6:
            return self.rng.choice(self.vocabulary)
        if roll < 0.8:
            return self.rng.choice(self.vocabulary).capitalize()
        if roll < 0.9:
            return str(self.rng.randint(0, 99999))
        return self._value(self.rng.choice(("symbol", "order", "city", "name")))

    def greeting(self) -> Dialogue:
        greeting = self.rng.choice(GREETINGS)
        answer = GREETING_ANSWERS[2] if greeting.startswith("Thank") else (
            self.rng.choice(GREETING_ANSWERS[:2]))  # fmt: skip
        messages = [{"role": "user", "content": greeting}, {"role": "assistant", "content": answer}]
        self._system(messages)
        tools = [self._tool(kind)[0] for kind in self._kinds()] if self.rng.random() < 0.5 else []
        return Dialogue(messages, tools)

    def _kinds(self) -> list[ToolKind]:
        return self.rng.sample(TOOL_KINDS, self.rng.choice((1, 1, 2, 2, 3)))

    # -- tools ------------------------------------------------------------------------------

    def tool_dialogue(self) -> Dialogue:
        kinds = self._kinds()
        tools = [self._tool(kind) for kind in kinds]
        kind = self.rng.choice(kinds)
        (tool, name) = tools[kinds.index(kind)]
        values = {param: self._value(pool) for param, pool in kind.parameters}
        question = self.rng.choice(kind.questions).format(**values)
        result = self._result(kind, values)
        arguments = {
            param: int(value) if pool == "int" else value
            for (param, pool), value in zip(kind.parameters, values.values(), strict=True)
        }
        call = {"name": name, "arguments": arguments}
        messages = [*self._history(), {"role": "user", "content": question}]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{self.rng.getrandbits(48):012x}", "type": "function", "function": call}
        ]})  # fmt: skip
        messages.append({"role": "tool", "content": result})
        answer = self.rng.choice(kind.answers).format(result=result, **values)
        messages.append({"role": "assistant", "content": answer})
        self._system(messages)
        return Dialogue(messages, [t for t, _ in tools], quote=result)

    def _value(self, pool: str) -> str:
        rng = self.rng
        if pool == "int":
            return str(rng.randint(0, 999))
        if pool == "symbol":
            return "".join(
                rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(2, 4))
            )
        if pool == "order":
            return f"{rng.choice('ABCDEFGHKMPQRTXZ')}-{rng.randint(100, 99999)}"
        if pool == "language":
            return rng.choice(LANGUAGES)
        if pool in ("city", "name") and rng.random() < 0.5:
            # As often a made-up one (a capitalized word): a model that could recall its
            # few real names would not need to copy them from the question.
            return rng.choice(self.pools["word"]).capitalize()
        return rng.choice(self.pools[pool])

    def _result(self, kind: ToolKind, values: dict[str, str]) -> str:
        rng = self.rng
        if kind.subject == "weather":
            return rng.choice((
                f"{rng.choice(CONDITIONS)}, {rng.randint(-20, 40)} C",
                f"{rng.choice(CONDITIONS)} and {rng.randint(-5, 100)} F",
                f"The weather in {values['city']} is {rng.choice(CONDITIONS)}.",
                json.dumps(
                    {"temperature": rng.randint(-20, 40), "condition": rng.choice(CONDITIONS)}
                ),
            ))  # fmt: skip
        if kind.subject == "time":
            return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        if kind.subject == "sum":
            return str(int(values["a"]) + int(values["b"]))
        if kind.subject == "product":
            return str(int(values["a"]) * int(values["b"]))
        if kind.subject == "documentation":
            return self.answers[values["topic"]]
        if kind.subject == "price":
            return f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d} USD"
        if kind.subject == "order":
            return rng.choice(("shipped", "delivered", "in transit", "being packed", "delayed"))
        if kind.subject == "user":
            return " ".join(rng.choice(self.vocabulary) for _ in range(rng.randint(2, 6)))
        if kind.subject == "letters":
            return str(len(values["word"]))
        return rng.choice(self.vocabulary)

    def _tool(self, kind: ToolKind) -> tuple[dict[str, Any], str]:
        """A tool of `kind` in one of the shapes clients send, and its name."""
        rng = self.rng
        name = rng.choice(kind.names)
        style = rng.choice(("openai", "pydantic", "langchain"))
        properties: dict[str, Any] = {}
        for param, pool in kind.parameters:
            schema: dict[str, Any] = {"type": JSON_TYPES.get(pool, "string")}
            if style == "pydantic":
                schema = {"title": param.replace("_", " ").title().replace(" ", ""), **schema}
            elif style == "openai" and rng.random() < 0.6:
                schema["description"] = f"The {param.replace('_', ' ')}"
            if pool == "language" and rng.random() < 0.5:
                schema["enum"] = list(LANGUAGES)
            properties[param] = schema
        required = [param for param, _ in kind.parameters]
        if style == "openai":
            parameters = {"type": "object", "properties": properties, "required": required}
        elif style == "pydantic":
            parameters = {"properties": properties, "required": required,
                          "title": f"{name}_args", "type": "object",
                          "additionalProperties": False}  # fmt: skip
        else:
            parameters = {"properties": properties, "required": required, "type": "object"}
        function: dict[str, Any] = {"name": name}
        if rng.random() < 0.85:
            function["description"] = rng.choice(kind.description)
        function["parameters"] = parameters
        if style == "pydantic" and rng.random() < 0.7:
            function["strict"] = True
        return {"type": "function", "function": function}, name
