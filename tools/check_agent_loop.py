"""The OpenAI Agents SDK's loop against a running server, over every city the embedded model
never saw in a tool conversation (tools/chat_corpus.py's held-out pool): for how many the
agent calls `get_weather` with the city, reads the result and answers with it, within 3
turns, at temperature 0, over the Responses API and over chat completions.

The test suite runs one such loop (tests/server/test_default_model_clients.py); this is the
rate over all of them, the figure server/default_model/README.md reports:

    .venv/bin/octavo serve --port 8011 &   # the embedded model, no flags
    .venv/bin/python -m tools.check_agent_loop --base-url http://127.0.0.1:8011
"""

from __future__ import annotations

import argparse
import asyncio
import json

FORECAST = "sunny, 18 C"
INSTRUCTIONS = "Use the tools to answer the user's questions."


async def run_loop(model, city: str) -> tuple[list[str], str]:
    """One Runner.run of an agent with a `get_weather` tool (which always answers FORECAST)
    on "What is the weather in CITY?": the cities it was called with and the final output.
    The SDK's errors (a model that never finishes) are raised."""
    from agents import Agent, ModelSettings, Runner, function_tool

    calls: list[str] = []

    @function_tool(name_override="get_weather")
    def weather(city: str) -> str:
        """Returns the weather in a city."""
        calls.append(city)
        return FORECAST

    agent = Agent(
        name="Weather",
        instructions=INSTRUCTIONS,
        tools=[weather],
        model=model,
        model_settings=ModelSettings(temperature=0),
    )
    result = await Runner.run(agent, f"What is the weather in {city}?", max_turns=3)
    return calls, str(result.final_output)


async def scored_loop(model, city: str) -> dict:
    """run_loop's calls and output, an error the SDK raised as the output, and whether the
    loop completed: one call with the city, and an answer quoting its result."""
    try:
        calls, output = await run_loop(model, city)
    except Exception as error:  # noqa: BLE001 -- the SDK's refusals are the figure's failures
        calls, output = [], f"{type(error).__name__}: {error}"
    return {"city": city, "calls": calls, "output": output,
            "ok": calls == [city] and FORECAST in output}  # fmt: skip


async def main_async(base_url: str, model_name: str) -> dict:
    import openai
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled

    from tools.chat_corpus import DialogueMaker

    set_tracing_disabled(True)  # traces would be exported to OpenAI's servers
    # The pools of values are split apart from the text: no text is needed for the cities.
    cities = DialogueMaker([], seed=0, held_out=True).pools["city"]
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    report = {}
    for name, kind in (
        ("responses", OpenAIResponsesModel),
        ("chat_completions", OpenAIChatCompletionsModel),
    ):
        model = kind(model=model_name, openai_client=client)
        runs = [await scored_loop(model, city) for city in cities]
        for run in runs:
            print(name, json.dumps(run))
        report[name] = {"completed": sum(run["ok"] for run in runs), "of": len(runs)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8011")
    parser.add_argument("--model", default="octavo-tiny-chat")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args.base_url, args.model))))


if __name__ == "__main__":
    main()
