//! One test per rule of the engine contract (issue 2 and the API contract of onnxruntime-genai's
//! Engine redesign, the pull request "Redesign experimental Engine turn API").

mod common;

use common::*;
use ortex_core::events::flags;
use ortex_core::{ErrorCode, RequestId, RequestOptions, RequestState, RunStart, TurnId, EVENT_STRIDE_WORDS};

fn req(engine: &mut ortex_core::Engine) -> RequestId {
    engine.create_request(&RequestOptions::default()).unwrap()
}

fn req_max(engine: &mut ortex_core::Engine, max_session_tokens: u32) -> RequestId {
    engine.create_request(&RequestOptions { max_session_tokens: Some(max_session_tokens) }).unwrap()
}

fn code<T: std::fmt::Debug>(result: ortex_core::Result<T>) -> ErrorCode {
    result.expect_err("call should be refused").code
}

#[test]
fn turn_ids_start_at_one_and_a_refused_begin_consumes_none() {
    let mut e = sim(r#"{"seed":1}"#);
    let r = req(&mut e);
    assert_eq!(code(e.begin_turn(r, &[], &turn_opts("{}"))), ErrorCode::InvalidArgument);
    assert_eq!(code(e.begin_turn(r, &[99_999], &turn_opts("{}"))), ErrorCode::InvalidArgument);
    let t1 = e.begin_turn(r, &[5, 6], &turn_opts(r#"{"maxGeneratedTokens":2}"#)).unwrap();
    assert_eq!(t1, TurnId(1));
    assert_eq!(code(e.begin_turn(r, &[5], &turn_opts("{}"))), ErrorCode::TurnActive);
    run_all(&mut e, 16);
    let t2 = e.begin_turn(r, &[7], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    assert_eq!(t2, TurnId(2));
}

#[test]
fn begin_turn_is_refused_while_events_are_pending() {
    let mut e = sim(r#"{"seed":1}"#);
    let a = req(&mut e);
    let b = req(&mut e);
    e.begin_turn(a, &[5], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    e.begin_turn(b, &[6], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    // Prefill of both prompts samples one token each: two finishing events, capacity one.
    let first = run(&mut e, 1);
    assert_eq!(first.len(), 1);
    assert!(first[0].is_finished());
    let other = if first[0].request == a.0 { b } else { a };
    assert_eq!(e.request_state(other).unwrap(), RequestState::TurnComplete);
    assert_eq!(code(e.begin_turn(other, &[5], &turn_opts("{}"))), ErrorCode::EventsPending);
    run(&mut e, 1);
    e.begin_turn(other, &[5], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
}

#[test]
fn capacity_one_paces_one_event_per_run() {
    let mut e = sim(r#"{"seed":2}"#);
    let ids: Vec<_> = (0..4).map(|_| req(&mut e)).collect();
    for &r in &ids {
        e.begin_turn(r, &[10, 11, 12], &turn_opts(r#"{"maxGeneratedTokens":3}"#)).unwrap();
    }
    let mut total = 0;
    while e.has_pending_work() {
        let events = run(&mut e, 1);
        assert!(events.len() <= 1);
        total += events.len();
    }
    assert_eq!(total, 4 * 3, "every token reaches the caller, one per run");
}

#[test]
fn retained_events_drain_without_executing() {
    let mut e = sim(r#"{"seed":3}"#);
    for _ in 0..5 {
        let r = req(&mut e);
        e.begin_turn(r, &[7, 8], &turn_opts(r#"{"maxGeneratedTokens":4}"#)).unwrap();
    }
    assert_eq!(run(&mut e, 2).len(), 2);
    let steps = e.stats().steps;
    assert_eq!(e.stats().retained_events, 3);
    // Spare capacity does not tempt the engine into model work while events are retained.
    assert_eq!(run(&mut e, 64).len(), 3);
    assert_eq!(e.stats().steps, steps);
    assert_eq!(run(&mut e, 64).len(), 5);
    assert_eq!(e.stats().steps, steps + 1);
}

#[test]
fn capacity_zero_is_a_validated_no_op() {
    let mut e = sim(r#"{"seed":3}"#);
    let r = req(&mut e);
    e.begin_turn(r, &[7], &turn_opts(r#"{"maxGeneratedTokens":2}"#)).unwrap();
    let mut empty: [i32; 0] = [];
    assert_eq!(e.run(&mut empty, 0).unwrap(), 0);
    assert_eq!(e.stats().steps, 0);
    let mut short = vec![0i32; EVENT_STRIDE_WORDS * 2 - 1];
    assert_eq!(code(e.run(&mut short, 2)), ErrorCode::InvalidArgument);
    assert_eq!(e.stats().steps, 0, "a bad buffer makes no progress");
    assert_eq!(run(&mut e, 2).len(), 1);
}

#[test]
fn partial_prefill_returns_no_events() {
    let mut e = sim(r#"{"seed":4,"maxScheduledTokens":8}"#);
    let r = req(&mut e);
    let prompt: Vec<i32> = (100..120).collect();
    e.begin_turn(r, &prompt, &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    assert!(run(&mut e, 8).is_empty());
    assert!(e.has_pending_work());
    assert!(run(&mut e, 8).is_empty());
    let last = run(&mut e, 8);
    assert_eq!(last.len(), 1);
    assert_eq!(last[0].usage, Some((20, 1, 0)));
    assert_eq!(e.stats().steps, 3);
}

#[test]
fn prefill_chunk_cap_limits_one_request_per_step() {
    let mut e = sim(r#"{"seed":4,"maxScheduledTokens":64,"prefillChunkSize":5}"#);
    let r = req(&mut e);
    e.begin_turn(r, &(100..112).collect::<Vec<_>>(), &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    let events = run_all(&mut e, 8);
    assert_eq!(events.len(), 1);
    assert_eq!(e.stats().steps, 3, "12 tokens in chunks of 5");
}

#[test]
fn chunked_and_batched_generation_gives_the_same_tokens_as_alone() {
    let prompt: Vec<i32> = (300..340).collect();
    let mut alone = sim(r#"{"seed":9}"#);
    let r = req(&mut alone);
    let t = alone.begin_turn(r, &prompt, &turn_opts(r#"{"maxGeneratedTokens":12}"#)).unwrap();
    let expected = tokens_of(&run_all(&mut alone, 16), r, t);

    let mut busy = sim(r#"{"seed":9,"maxScheduledTokens":7,"maxBatchSize":3,"blockSize":4}"#);
    let others: Vec<_> = (0..4).map(|_| req(&mut busy)).collect();
    for (i, &o) in others.iter().enumerate() {
        busy.begin_turn(o, &[50 + i as i32; 9], &turn_opts(r#"{"maxGeneratedTokens":20}"#)).unwrap();
    }
    let r2 = req(&mut busy);
    let t2 = busy.begin_turn(r2, &prompt, &turn_opts(r#"{"maxGeneratedTokens":12}"#)).unwrap();
    assert_eq!(tokens_of(&run_all(&mut busy, 3), r2, t2), expected);
}

#[test]
fn per_turn_budgets_across_continuations() {
    let mut e = sim(r#"{"seed":5}"#);
    let r = req_max(&mut e, 20);
    let t1 = e.begin_turn(r, &[1, 2, 3], &turn_opts(r#"{"maxGeneratedTokens":4}"#)).unwrap();
    let ev = run_all(&mut e, 8);
    assert_eq!(tokens_of(&ev, r, t1).len(), 4);
    assert_eq!(finish_of(&ev, r, t1)[0].finish, FINISH_MAX_GENERATED);
    assert_eq!(finish_of(&ev, r, t1)[0].usage, Some((3, 4, 0)));
    assert_eq!(e.token_count(r).unwrap(), 7);
    // The continuation counts only its new input; the session limit (20) bounds the whole request.
    let t2 = e.begin_turn(r, &[9, 9], &turn_opts(r#"{"maxGeneratedTokens":100}"#)).unwrap();
    let ev = run_all(&mut e, 8);
    assert_eq!(tokens_of(&ev, r, t2).len(), 11);
    let fin = finish_of(&ev, r, t2)[0];
    assert_eq!(fin.finish, FINISH_MAX_SESSION);
    assert_eq!(fin.usage, Some((2, 11, 0)));
    assert_eq!(e.token_count(r).unwrap(), 20);
    assert_eq!(code(e.begin_turn(r, &[1], &turn_opts("{}"))), ErrorCode::InvalidArgument);
}

#[test]
fn max_session_tokens_zero_means_max_length_and_above_is_an_error() {
    let mut e = sim(r#"{"seed":5,"maxLength":32}"#);
    let r = e.create_request(&RequestOptions { max_session_tokens: Some(0) }).unwrap();
    let t = e.begin_turn(r, &[4; 10], &turn_opts("{}")).unwrap();
    let ev = run_all(&mut e, 8);
    assert_eq!(tokens_of(&ev, r, t).len(), 22);
    assert_eq!(finish_of(&ev, r, t)[0].finish, FINISH_MAX_SESSION);
    assert_eq!(code(e.create_request(&RequestOptions { max_session_tokens: Some(33) })), ErrorCode::InvalidArgument);
    let fresh = req(&mut e);
    assert_eq!(code(e.begin_turn(fresh, &[4; 32], &turn_opts("{}"))), ErrorCode::InvalidArgument);
}

#[test]
fn input_is_copied_at_begin_turn() {
    let mut a = sim(r#"{"seed":6}"#);
    let mut b = sim(r#"{"seed":6}"#);
    let (ra, rb) = (req(&mut a), req(&mut b));
    let mut input = vec![40, 41, 42];
    let ta = a.begin_turn(ra, &input, &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    input[0] = 99;
    let tb = b.begin_turn(rb, &[40, 41, 42], &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    assert_eq!(tokens_of(&run_all(&mut a, 8), ra, ta), tokens_of(&run_all(&mut b, 8), rb, tb));
}

#[test]
fn eos_ends_a_turn_unless_ignored() {
    let mut e = sim(r#"{"seed":7,"eosProbability":1}"#);
    let r = req(&mut e);
    let t = e.begin_turn(r, &[5], &turn_opts("{}")).unwrap();
    let ev = run_all(&mut e, 4);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].token, 2);
    assert_eq!(ev[0].finish, FINISH_EOS);
    let t2 = e.begin_turn(r, &[5], &turn_opts(r#"{"ignoreEos":true,"maxGeneratedTokens":3}"#)).unwrap();
    let ev = run_all(&mut e, 4);
    assert_eq!(tokens_of(&ev, r, t2), vec![2, 2, 2]);
    assert_eq!(finish_of(&ev, r, t2)[0].finish, FINISH_MAX_GENERATED);
    let _ = t;
}

#[test]
fn stop_token_sequences_end_a_turn() {
    let mut probe = sim(r#"{"seed":8}"#);
    let r = req(&mut probe);
    let t = probe.begin_turn(r, &[5, 6], &turn_opts(r#"{"maxGeneratedTokens":6}"#)).unwrap();
    let tokens = tokens_of(&run_all(&mut probe, 4), r, t);
    let mut e = sim(r#"{"seed":8}"#);
    let r = req(&mut e);
    let stop = format!(r#"{{"stopTokenIds":[[{}, {}]]}}"#, tokens[2], tokens[3]);
    let t = e.begin_turn(r, &[5, 6], &turn_opts(&stop)).unwrap();
    let ev = run_all(&mut e, 4);
    assert_eq!(tokens_of(&ev, r, t), tokens[..4].to_vec());
    assert_eq!(finish_of(&ev, r, t)[0].finish, FINISH_STOP);
}

#[test]
fn cancel_true_then_false() {
    let mut e = sim(r#"{"seed":9}"#);
    let r = req(&mut e);
    let t = e.begin_turn(r, &[5, 6], &turn_opts(r#"{"maxGeneratedTokens":50}"#)).unwrap();
    run(&mut e, 4);
    run(&mut e, 4);
    assert!(e.cancel_turn(r, t).unwrap());
    assert!(!e.cancel_turn(r, t).unwrap(), "a completed turn id");
    assert!(!e.cancel_turn(r, TurnId(7)).unwrap(), "an unknown turn id");
    let ev = run_all(&mut e, 4);
    assert_eq!(ev.len(), 1, "exactly one finish event");
    assert_eq!(ev[0].finish, FINISH_CANCELLED);
    assert_eq!(ev[0].flags, flags::TURN_FINISHED);
    assert_eq!(ev[0].usage, Some((2, 2, 0)));
    assert_eq!(e.token_count(r).unwrap(), 4, "committed tokens stay");
    e.close_request(r).unwrap();
    assert_eq!(code(e.cancel_turn(r, t)), ErrorCode::RequestClosed);
}

#[test]
fn cancel_of_a_queued_turn_finishes_it_at_once() {
    let mut e = sim(r#"{"seed":9}"#);
    let r = req(&mut e);
    let t = e.begin_turn(r, &[5, 6], &turn_opts("{}")).unwrap();
    assert_eq!(e.request_state(r).unwrap(), RequestState::Queued);
    assert!(e.cancel_turn(r, t).unwrap());
    let ev = run(&mut e, 4);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].finish, FINISH_CANCELLED);
    assert_eq!(ev[0].usage, Some((2, 0, 0)));
    assert_eq!(e.stats().steps, 0);
}

#[test]
fn cancel_merges_into_a_pending_token_event() {
    let mut e = sim(r#"{"seed":10}"#);
    let a = req(&mut e);
    let b = req(&mut e);
    let ta = e.begin_turn(a, &[5], &turn_opts(r#"{"maxGeneratedTokens":9}"#)).unwrap();
    e.begin_turn(b, &[6], &turn_opts(r#"{"maxGeneratedTokens":9}"#)).unwrap();
    let first = run(&mut e, 1);
    assert_eq!(first[0].request, a.0);
    // b's token event is retained; a's next token is not yet produced. Cancel b's turn: merged.
    let tb = TurnId(1);
    assert!(e.cancel_turn(b, tb).unwrap());
    let ev = run(&mut e, 4);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].request, b.0);
    assert_eq!(ev[0].flags, flags::TOKEN | flags::TURN_FINISHED);
    assert_eq!(ev[0].finish, FINISH_CANCELLED);
    let _ = ta;
}

#[test]
fn close_from_every_state() {
    let mut e = sim(r#"{"seed":11,"maxScheduledTokens":4}"#);
    let total = e.stats().total_blocks;
    let created = req(&mut e);
    let active = req(&mut e);
    e.begin_turn(active, &[5], &turn_opts(r#"{"maxGeneratedTokens":100}"#)).unwrap();
    let complete = req(&mut e);
    e.begin_turn(complete, &[5], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    let queued = req(&mut e);
    e.begin_turn(queued, &[5; 10], &turn_opts("{}")).unwrap();
    run(&mut e, 8);
    assert_eq!(e.request_state(created).unwrap(), RequestState::Created);
    assert_eq!(e.request_state(queued).unwrap(), RequestState::Queued);
    assert_eq!(e.request_state(active).unwrap(), RequestState::Active);
    assert_eq!(e.request_state(complete).unwrap(), RequestState::TurnComplete);
    for r in [created, queued, active, complete] {
        e.close_request(r).unwrap();
        e.close_request(r).unwrap();
        assert_eq!(e.request_state(r).unwrap(), RequestState::Closed);
        e.check_invariants();
    }
    assert_eq!(e.stats().free_blocks, total);
    assert!(!e.has_pending_work());
    assert!(run(&mut e, 8).is_empty(), "no event for a closed request");
    assert_eq!(code(e.close_request(RequestId(99))), ErrorCode::InvalidArgument);
    e.close();
    e.close_request(created).unwrap();
    assert_eq!(code(e.create_request(&RequestOptions::default())), ErrorCode::EngineClosed);
}

#[test]
fn close_while_a_step_is_in_flight_frees_blocks_when_it_commits() {
    let mut e = sim(r#"{"seed":12}"#);
    let total = e.stats().total_blocks;
    let r = req(&mut e);
    let other = req(&mut e);
    e.begin_turn(r, &[5; 40], &turn_opts("{}")).unwrap();
    let mut buf = vec![0i32; 4 * EVENT_STRIDE_WORDS];
    let RunStart::Execute(mut tx) = e.run_begin(&mut buf, 4).unwrap() else { panic!("expected a transaction") };
    e.close_request(r).unwrap();
    assert_eq!(e.request_state(r).unwrap(), RequestState::Closed);
    // Other calls keep working while the step is away.
    let t = e.begin_turn(other, &[6], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    assert_eq!(code(e.run(&mut buf, 4)), ErrorCode::RunInProgress);
    tx.execute();
    let n = e.run_commit(tx, &mut buf, 4);
    assert_eq!(n, 0, "the closed request's token is dropped");
    e.check_invariants();
    let ev = run_all(&mut e, 4);
    assert_eq!(tokens_of(&ev, other, t).len(), 1);
    assert_eq!(e.stats().free_blocks + 1, total, "only the other request's block is held");
}

#[test]
fn reclaimed_requests_free_their_blocks() {
    let mut e = sim(r#"{"seed":13}"#);
    let total = e.stats().total_blocks;
    let r = req(&mut e);
    e.begin_turn(r, &[5; 33], &turn_opts(r#"{"maxGeneratedTokens":3}"#)).unwrap();
    run(&mut e, 4);
    assert!(e.stats().free_blocks < total);
    e.abandon_request(r);
    assert_eq!(e.request_state(r).unwrap(), RequestState::Active, "reclaimed at the next boundary, not before");
    assert!(!e.has_pending_work());
    assert_eq!(e.request_state(r).unwrap(), RequestState::Closed);
    assert_eq!(e.stats().free_blocks, total);
}

#[test]
fn rollback_after_a_retryable_failure_leaks_no_block() {
    let plain_json = r#"{"seed":14,"blockSize":4}"#;
    let faulty_json = r#"{"seed":14,"blockSize":4,"faults":{"retryableSteps":[0,2,3]}}"#;
    let mut results = Vec::new();
    for json in [plain_json, faulty_json] {
        let mut e = sim(json);
        let r = req(&mut e);
        let t = e.begin_turn(r, &[5; 9], &turn_opts(r#"{"maxGeneratedTokens":6}"#)).unwrap();
        let ev = run_all(&mut e, 4);
        let retries: Vec<_> = ev.iter().filter(|x| x.flags & flags::RETRYABLE != 0).collect();
        assert!(retries.iter().all(|x| x.request == 0 && x.error == ERR_RETRYABLE));
        results.push((tokens_of(&ev, r, t), retries.len()));
        e.close_request(r).unwrap();
        assert_eq!(e.stats().free_blocks, e.stats().total_blocks);
    }
    assert_eq!(results[0].0, results[1].0, "a retried step produces the same tokens");
    assert_eq!((results[0].1, results[1].1), (0, 3));
}

#[test]
fn execution_capacity_failure_is_a_capacity_event_and_loses_nothing() {
    let mut e = sim(r#"{"seed":14,"faults":{"capacitySteps":[1]}}"#);
    let r = req(&mut e);
    let t = e.begin_turn(r, &[5; 3], &turn_opts(r#"{"maxGeneratedTokens":3}"#)).unwrap();
    let ev = run_all(&mut e, 4);
    assert!(ev.iter().any(|x| x.request == 0 && x.flags == flags::CAPACITY_BLOCKED && x.error == ERR_EXEC_CAPACITY));
    assert_eq!(tokens_of(&ev, r, t).len(), 3);
}

#[test]
fn unhealthy_after_fatal() {
    let mut e = sim(r#"{"seed":15,"faults":{"fatalSteps":[1]}}"#);
    let r = req(&mut e);
    e.begin_turn(r, &[5; 3], &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    run(&mut e, 4);
    let ev = run(&mut e, 4);
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].request, ev[0].flags, ev[0].error), (0, flags::FAILED, ERR_FATAL));
    let mut buf = vec![0i32; 4 * EVENT_STRIDE_WORDS];
    assert_eq!(code(e.run(&mut buf, 4)), ErrorCode::EngineUnhealthy);
    assert_eq!(code(e.create_request(&RequestOptions::default())), ErrorCode::EngineUnhealthy);
    assert_eq!(code(e.begin_turn(r, &[5], &turn_opts("{}"))), ErrorCode::EngineUnhealthy);
    e.close_request(r).unwrap();
    e.close();
}

/// Issue 30: an unhealthy engine refuses every owner boundary, so it reclaims a dropped request
/// at once: one dropped while the failing step was in flight, and one dropped afterwards.
#[test]
fn an_unhealthy_engine_reclaims_dropped_requests_at_once() {
    let mut e = sim(r#"{"seed":15,"blockSize":4,"faults":{"fatalSteps":[0]}}"#);
    let (during, after) = (req(&mut e), req(&mut e));
    for r in [during, after] {
        e.begin_turn(r, &[5; 9], &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    }
    let mut buf = vec![0i32; 4 * EVENT_STRIDE_WORDS];
    let RunStart::Execute(mut tx) = e.run_begin(&mut buf, 4).unwrap() else { panic!("a step is planned") };
    e.abandon_request(during);
    tx.execute();
    let written = e.run_commit(tx, &mut buf, 4);
    let ev = decode(&buf, written);
    assert_eq!(ev.iter().map(|x| (x.request, x.flags)).collect::<Vec<_>>(), [(0, flags::FAILED)], "only the failure");
    assert_eq!(e.request_state(during).unwrap(), RequestState::Closed, "dropped in flight: closed at the failure");
    e.abandon_request(after);
    assert_eq!(e.request_state(after).unwrap(), RequestState::Closed, "dropped afterwards: closed at once");
    e.check_invariants();
    let stats = e.stats();
    assert_eq!((stats.active_requests, stats.pending_turns, stats.free_blocks), (0, 0, stats.total_blocks));
}

#[test]
fn unserviceable_request_fails_alone() {
    let mut e = sim(r#"{"seed":16,"blockSize":4,"numBlocks":4}"#);
    let big = req(&mut e);
    let small = req(&mut e);
    let tb = e.begin_turn(big, &[5; 17], &turn_opts("{}")).unwrap();
    let ts = e.begin_turn(small, &[5; 3], &turn_opts(r#"{"maxGeneratedTokens":2}"#)).unwrap();
    let ev = run_all(&mut e, 4);
    let fail = finish_of(&ev, big, tb);
    assert_eq!(fail.len(), 1);
    assert_eq!(
        (fail[0].finish, fail[0].error, fail[0].flags & flags::FAILED),
        (FINISH_FAILED, ERR_UNSERVICEABLE, flags::FAILED)
    );
    assert_eq!(tokens_of(&ev, small, ts).len(), 2);
}

#[test]
fn a_request_that_fits_later_waits_and_loses_nothing() {
    let expected = {
        let mut e = sim(r#"{"seed":17}"#);
        let r = req(&mut e);
        let t = e.begin_turn(r, &[8; 6], &turn_opts(r#"{"maxGeneratedTokens":8}"#)).unwrap();
        tokens_of(&run_all(&mut e, 4), r, t)
    };
    let mut e = sim(r#"{"seed":17,"blockSize":4,"numBlocks":4}"#);
    let hog = req(&mut e);
    let th = e.begin_turn(hog, &[3; 10], &turn_opts(r#"{"maxGeneratedTokens":4}"#)).unwrap();
    let mut ev = run(&mut e, 4);
    let r = req(&mut e);
    let t = e.begin_turn(r, &[8; 6], &turn_opts(r#"{"maxGeneratedTokens":8}"#)).unwrap();
    ev.extend(run_all(&mut e, 4));
    let blocked: Vec<_> = ev.iter().filter(|x| x.flags & flags::CAPACITY_BLOCKED != 0).collect();
    assert!(!blocked.is_empty(), "the waiting request was told it waits");
    assert!(blocked.iter().all(|x| x.error == ERR_CAPACITY_DEFERRED && x.request != 0));
    assert_eq!(tokens_of(&ev, r, t), expected);
    assert_eq!(tokens_of(&ev, hog, th).len(), 4);
}

#[test]
fn preemption_recomputes_without_losing_tokens() {
    let alone = |prompt: &[i32]| {
        let mut e = sim(r#"{"seed":18}"#);
        let r = req(&mut e);
        let t = e.begin_turn(r, prompt, &turn_opts(r#"{"maxGeneratedTokens":10}"#)).unwrap();
        tokens_of(&run_all(&mut e, 4), r, t)
    };
    // Two requests that each fit the pool but not together: one is preempted and recomputed.
    let mut e = sim(r#"{"seed":18,"blockSize":4,"numBlocks":5}"#);
    let a = req(&mut e);
    let b = req(&mut e);
    let ta = e.begin_turn(a, &[11; 6], &turn_opts(r#"{"maxGeneratedTokens":10}"#)).unwrap();
    let tb = e.begin_turn(b, &[12; 6], &turn_opts(r#"{"maxGeneratedTokens":10}"#)).unwrap();
    let ev = run_all(&mut e, 4);
    assert_eq!(tokens_of(&ev, a, ta), alone(&[11; 6]));
    assert_eq!(tokens_of(&ev, b, tb), alone(&[12; 6]));
}

#[test]
fn decodes_run_first_in_a_stable_order() {
    let mut e = sim(r#"{"seed":19,"maxBatchSize":2}"#);
    let a = req(&mut e);
    let b = req(&mut e);
    let c = req(&mut e);
    e.begin_turn(a, &[5], &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    e.begin_turn(b, &[5], &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    run(&mut e, 8);
    e.begin_turn(c, &[5], &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    // Two rows per step: a and b keep decoding, in id order; c waits (until it starves).
    let ev = run(&mut e, 8);
    assert_eq!(ev.iter().map(|x| x.request).collect::<Vec<_>>(), vec![a.0, b.0]);
}

#[test]
fn no_prefill_starvation_under_sustained_decode() {
    let wait_steps = 3;
    let mut e = sim(&format!(r#"{{"seed":20,"maxBatchSize":4,"maxPrefillWaitSteps":{wait_steps}}}"#));
    let decoders: Vec<_> = (0..4).map(|_| req(&mut e)).collect();
    for &d in &decoders {
        e.begin_turn(d, &[5], &turn_opts(r#"{"maxGeneratedTokens":1000,"ignoreEos":true}"#)).unwrap();
    }
    run(&mut e, 8);
    let newcomers: Vec<_> = (0..6).map(|_| req(&mut e)).collect();
    for &n in &newcomers {
        e.begin_turn(n, &[7, 7], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    }
    // Each newcomer gets its first token within a bound: waiting steps plus one step per row of
    // older newcomers ahead of it.
    let bound = wait_steps as usize + newcomers.len() + 1;
    let mut served = std::collections::BTreeMap::new();
    for step in 1..=bound {
        for ev in run(&mut e, 16) {
            if newcomers.iter().any(|n| n.0 == ev.request) && ev.is_token() {
                served.entry(ev.request).or_insert(step);
            }
        }
    }
    assert_eq!(served.len(), newcomers.len(), "served within {bound} steps: {served:?}");
}

#[test]
fn static_batch_is_recycled_only_when_all_rows_are_done() {
    let mut e = sim(r#"{"seed":21,"batching":"static","maxBatchSize":2}"#);
    let a = req(&mut e);
    let b = req(&mut e);
    let c = req(&mut e);
    e.begin_turn(a, &[5], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    e.begin_turn(b, &[5], &turn_opts(r#"{"maxGeneratedTokens":4}"#)).unwrap();
    e.begin_turn(c, &[5], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    let mut first_token_step = std::collections::BTreeMap::new();
    let mut step = 0;
    while e.has_pending_work() {
        step += 1;
        for ev in run(&mut e, 8) {
            first_token_step.entry(ev.request).or_insert(step);
        }
    }
    // a finishes at step 1, but c only starts once b (the batch's last row) is done at step 4.
    assert_eq!(first_token_step[&a.0], 1);
    assert_eq!(first_token_step[&b.0], 1);
    assert_eq!(first_token_step[&c.0], 5);
}

#[test]
fn static_batch_keeps_a_closed_row_until_recycled() {
    let mut e = sim(r#"{"seed":21,"batching":"static","maxBatchSize":2}"#);
    let total = e.stats().total_blocks;
    let a = req(&mut e);
    let b = req(&mut e);
    e.begin_turn(a, &[5], &turn_opts(r#"{"maxGeneratedTokens":3}"#)).unwrap();
    e.begin_turn(b, &[5], &turn_opts(r#"{"maxGeneratedTokens":6}"#)).unwrap();
    run(&mut e, 8);
    e.close_request(a).unwrap();
    assert_eq!(e.stats().free_blocks, total - 2, "the closed row stays allocated");
    run_all(&mut e, 8);
    e.close_request(b).unwrap();
    let c = req(&mut e);
    e.begin_turn(c, &[5], &turn_opts(r#"{"maxGeneratedTokens":1}"#)).unwrap();
    run_all(&mut e, 8);
    e.close_request(c).unwrap();
    assert!(!e.has_pending_work());
    run(&mut e, 1);
    assert_eq!(e.stats().free_blocks, total, "recycling released the closed rows");
}

#[test]
fn continuation_turns_reuse_the_resident_kv() {
    let mut e = sim(r#"{"seed":22}"#);
    let r = req(&mut e);
    e.begin_turn(r, &[5; 20], &turn_opts(r#"{"maxGeneratedTokens":3}"#)).unwrap();
    run_all(&mut e, 8);
    let prompt_before = e.stats().prompt_tokens;
    let t2 = e.begin_turn(r, &[6, 7], &turn_opts(r#"{"maxGeneratedTokens":2}"#)).unwrap();
    let ev = run_all(&mut e, 8);
    // Only the last sampled token and the 2 new input tokens are prefilled, not the 20-token prompt.
    assert_eq!(e.stats().prompt_tokens - prompt_before, 1 + 2);
    assert_eq!(finish_of(&ev, r, t2)[0].usage, Some((2, 2, 0)));
}

#[test]
fn prefill_adds_context_that_a_later_turn_continues() {
    let with_prefill = {
        let mut e = sim(r#"{"seed":23}"#);
        let r = req(&mut e);
        e.prefill(r, &[30, 31, 32]).unwrap();
        assert!(e.has_pending_work());
        assert!(run_all(&mut e, 4).is_empty(), "a prefill publishes no event");
        assert_eq!(e.request_state(r).unwrap(), RequestState::Created);
        let t = e.begin_turn(r, &[33], &turn_opts(r#"{"maxGeneratedTokens":4}"#)).unwrap();
        let ev = run_all(&mut e, 4);
        assert_eq!(finish_of(&ev, r, t)[0].usage, Some((1, 4, 0)));
        tokens_of(&ev, r, t)
    };
    let mut e = sim(r#"{"seed":23}"#);
    let r = req(&mut e);
    let t = e.begin_turn(r, &[30, 31, 32, 33], &turn_opts(r#"{"maxGeneratedTokens":4}"#)).unwrap();
    assert_eq!(tokens_of(&run_all(&mut e, 4), r, t), with_prefill);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let sample = |engine_seed: u64, turn_seed: Option<u64>| {
        let mut e = sim(&format!(r#"{{"seed":{engine_seed}}}"#));
        let r = req(&mut e);
        let opts = match turn_seed {
            Some(s) => format!(r#"{{"temperature":1.0,"seed":{s},"maxGeneratedTokens":16}}"#),
            None => r#"{"temperature":1.0,"maxGeneratedTokens":16}"#.to_string(),
        };
        let t = e.begin_turn(r, &[5], &turn_opts(&opts)).unwrap();
        tokens_of(&run_all(&mut e, 4), r, t)
    };
    assert_eq!(sample(1, Some(42)), sample(1, Some(42)));
    assert_ne!(sample(1, Some(42)), sample(1, Some(43)));
    assert_eq!(sample(3, None), sample(3, None));
    assert_ne!(sample(3, None), sample(4, None));
}

#[test]
fn at_most_one_event_per_request_per_transaction() {
    let mut e = sim(r#"{"seed":24,"maxScheduledTokens":4}"#);
    for _ in 0..6 {
        let r = req(&mut e);
        e.begin_turn(r, &[5, 6, 7], &turn_opts(r#"{"maxGeneratedTokens":5}"#)).unwrap();
    }
    while e.has_pending_work() {
        let ev = run(&mut e, 64);
        let mut ids: Vec<_> = ev.iter().map(|x| x.request).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), ev.len());
    }
}
