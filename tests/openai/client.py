"""Streams chat completions through the proxy with the official OpenAI library until the
proxy refuses one for the API key's token budget; prints what it saw as one JSON line.

    client.py BASE_URL API_KEY MAX_CALLS
"""
import json
import sys

import openai


def main():
    base_url, api_key, most = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # No retries: the library's own would wait out Retry-After and hide the 429.
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    seen = {"calls": [], "refused": None}
    for _ in range(most):
        try:
            stream = client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": "Say hello."}],
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage.total_tokens
            seen["calls"].append({"text": text, "total_tokens": usage})
        except openai.RateLimitError as e:
            seen["refused"] = {
                "status": e.status_code,
                "retry_after": e.response.headers.get("retry-after"),
                "policy": e.response.headers.get("ratelimit-policy"),
            }
            break
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
