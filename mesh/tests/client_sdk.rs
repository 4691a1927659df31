//! The client SDK against real gateways: typed calls, streaming, an agent loop,
//! and failover when the gateway in use is killed.

use crate::common;

use common::mesh_up;
use futures::StreamExt;
use mesh::client::{ChatDelta, ChatRequest, Client, ClientError, Message};
use serde_json::json;

fn weather_tool() -> serde_json::Value {
    json!({"type": "function", "function": {"name": "weather_get_forecast",
        "description": "Get the forecast for a city on a date.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "date": {"type": "string", "description": "Date as YYYY-MM-DD"}},
            "required": ["city", "date"]}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_fails_over_when_its_gateway_dies() {
    let mut a = mesh_up(&[]);
    let b = mesh_up(&[]);
    // A dead address first: the client must skip it.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let client = Client::new([dead, a.http.clone(), b.http.clone()]).unwrap();
    let mut req = ChatRequest::new(
        "t1",
        vec![Message::user(
            "What is the forecast in Oslo for 2026-05-01?",
        )],
    );
    req.tools = vec![weather_tool()];
    req.max_tokens = Some(64);
    let first = client
        .chat(&req)
        .await
        .expect("served despite a dead first address");
    let msg = &first.choices[0].message;
    assert!(first.usage.completion_tokens > 0);

    // Streaming gives the same answer as the plain call.
    let mut s = Box::pin(client.chat_stream(&req).await.unwrap());
    let (mut content, mut calls, mut finished) = (String::new(), vec![], None);
    while let Some(d) = s.next().await {
        match d.unwrap() {
            ChatDelta::Content(t) => content.push_str(&t),
            ChatDelta::ToolCall(c) => calls.push(c.function),
            ChatDelta::Reasoning(_) => {}
            ChatDelta::Finished { reason } => finished = Some(reason),
        }
    }
    assert_eq!(
        calls,
        msg.tool_calls
            .iter()
            .map(|c| c.function.clone())
            .collect::<Vec<_>>()
    );
    assert_eq!(
        finished.as_deref(),
        first.choices[0].finish_reason.as_deref()
    );

    // Kill the gateway in use: the next call lands on b with the same answer.
    a.kill();
    let again = client
        .chat(&req)
        .await
        .expect("served by the surviving gateway");
    assert_eq!(
        again.choices[0]
            .message
            .tool_calls
            .iter()
            .map(|c| &c.function)
            .collect::<Vec<_>>(),
        msg.tool_calls
            .iter()
            .map(|c| &c.function)
            .collect::<Vec<_>>()
    );

    // An agent loop runs tools until the model answers.
    let mut ran = 0;
    let result = client
        .run_agent(
            "t1",
            vec![Message::user(
                "What is the forecast in Lima for 2026-06-02?",
            )],
            vec![weather_tool()],
            3,
            |call| {
                ran += 1;
                assert_eq!(call.function.name, "weather_get_forecast");
                json!({"forecast": "sunny", "high_c": 24}).to_string()
            },
        )
        .await;
    match result {
        Ok((_, convo)) => assert!(convo.iter().any(|m| m.role == "tool")),
        Err(ClientError::TooManySteps(3)) => assert_eq!(ran, 3),
        Err(e) => panic!("agent failed: {e}"),
    }
    assert!(ran >= 1, "the model never called the tool");

    // Refusals are not retried and say why.
    let bad = ChatRequest::new("no-such-tier", vec![Message::user("hi")]);
    match client.chat(&bad).await {
        Err(ClientError::Refused {
            status: 404,
            message,
        }) => assert!(message.contains("no-such-tier")),
        other => panic!("expected 404, got {other:?}"),
    }
}
