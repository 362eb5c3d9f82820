"""Tools and reasoning in a chat request: how its output is read and what constrains it.

`tools` plans a request's `tools` / `tool_choice`, `tool_parsers/` reads calls out of model
text (hermes, llama3_json, mistral, and the JSON of guided choices), `reasoning` splits
`<think>` text off the content and fits a constraint after it, `message` turns a choice's
text into reasoning, content and calls (streamed or whole), and `chat_plan` ties them into a
chat request (`Agents`, from the server's `AgentSettings`).
"""
