"""`classify` (Python): asks the chat model what a ticket is about.

Handles `ticket` events from `intake` (Rust). The model answers
``{"intent": "order-status" | "refund" | "general", "order_id": ...}``. A ticket about an
order goes on to `resolve` (JavaScript) as a `resolve` event; any other is answered here.
``classified_at`` comes from ``time.time()``: durable, so a replay sends the same instant.
"""

import json
import time

import rewind

SYSTEM_PROMPT = (
    "You triage customer support tickets for an online shop. Classify the ticket and "
    "extract the order id it mentions, if any. Answer with a single JSON object and nothing "
    'else: {"intent": "order-status" | "refund" | "general", "order_id": string or null}.'
)


class Classify(rewind.Action):
    def run(self, ctx: rewind.Context, event: rewind.Event) -> None:
        ticket = event.payload
        answer = ctx.call(
            "llm.chat",
            {
                "messages": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": ticket["text"]},
                ]
            },
        )
        try:
            classification = json.loads(answer.get("content") or "")
        except ValueError:
            ctx.warn(f"request {ticket['request_id']}: the model's answer is not JSON")
            classification = {"intent": "general", "order_id": None}
        intent = classification.get("intent", "general")
        order_id = classification.get("order_id")
        ctx.info(f"request {ticket['request_id']} is about {intent}")

        if order_id:
            ctx.send(
                "resolve",
                {
                    "request_id": ticket["request_id"],
                    "customer": ticket["customer"],
                    "intent": intent,
                    "order_id": order_id,
                    "classified_at": round(time.time(), 3),
                },
            )
        else:
            ctx.output(
                {
                    "request_id": ticket["request_id"],
                    "intent": intent,
                    "reply": "Thanks for reaching out! Please tell us your order number "
                    "(it looks like A1234) and we will look into it.",
                }
            )


WitWorld = rewind.export(Classify)
