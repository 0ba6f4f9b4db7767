//! Holding a turn (Engine::hold_turn / release_turn): the pacing a streaming consumer that stops
//! reading puts on generation (issue 30, item 5).

mod common;

use common::*;
use ortex_core::{Engine, RequestId, RequestOptions, TurnId};

fn req(engine: &mut Engine) -> RequestId {
    engine.create_request(&RequestOptions::default()).unwrap()
}

fn generated(events: &[Ev], request: RequestId) -> usize {
    events.iter().filter(|e| e.request == request.0 && e.is_token()).count()
}

/// The tokens of one turn run alone, never held.
fn unheld_tokens(engine_json: &str, prompt: &[i32], turn_json: &str) -> Vec<i32> {
    let mut e = sim(engine_json);
    let r = req(&mut e);
    let t = e.begin_turn(r, prompt, &turn_opts(turn_json)).unwrap();
    tokens_of(&run_all(&mut e, 8), r, t)
}

#[test]
fn a_held_turn_gets_no_tokens_while_others_run() {
    let mut e = sim(r#"{"seed":40}"#);
    let (a, b) = (req(&mut e), req(&mut e));
    let ta = e.begin_turn(a, &[5, 6], &turn_opts(r#"{"maxGeneratedTokens":50,"ignoreEos":true}"#)).unwrap();
    let tb = e.begin_turn(b, &[7, 8], &turn_opts(r#"{"maxGeneratedTokens":20,"ignoreEos":true}"#)).unwrap();
    let mut events = run(&mut e, 8);
    assert!(e.hold_turn(a, ta).unwrap());
    assert!(e.is_turn_held(a).unwrap());
    let before = generated(&events, a);
    let held_events = run_all(&mut e, 8);
    events.extend_from_slice(&held_events);
    assert_eq!(generated(&held_events, a), 0, "a held turn generates nothing");
    assert_eq!(tokens_of(&events, b, tb).len(), 20, "the other turn ran to its end");
    assert!(!e.has_pending_work(), "a held turn alone is no pending work");
    assert_eq!(e.stats().pending_turns, 1, "the held turn is still running");
    assert!(e.release_turn(a, ta).unwrap());
    events.extend(run_all(&mut e, 8));
    assert_eq!(generated(&events, a), 50);
    assert!(before > 0);
}

#[test]
fn a_released_turn_has_the_tokens_of_an_unheld_one() {
    for turn_json in [
        r#"{"maxGeneratedTokens":40,"ignoreEos":true,"temperature":0}"#,
        r#"{"maxGeneratedTokens":40,"ignoreEos":true,"temperature":1,"topP":0.9,"seed":1234}"#,
    ] {
        let engine_json = r#"{"seed":41}"#;
        let expected = unheld_tokens(engine_json, &[9, 10, 11], turn_json);
        let mut e = sim(engine_json);
        let other = req(&mut e);
        e.begin_turn(other, &[3; 5], &turn_opts(r#"{"maxGeneratedTokens":30,"ignoreEos":true}"#)).unwrap();
        let r = req(&mut e);
        let t = e.begin_turn(r, &[9, 10, 11], &turn_opts(turn_json)).unwrap();
        let mut events = Vec::new();
        // Hold and release it every few steps while the other turn runs beside it.
        for round in 0..30 {
            if round % 3 == 0 {
                e.hold_turn(r, t).unwrap();
            } else {
                e.release_turn(r, t).unwrap();
            }
            events.extend(run(&mut e, 8));
        }
        e.release_turn(r, t).unwrap();
        events.extend(run_all(&mut e, 8));
        assert_eq!(tokens_of(&events, r, t), expected, "{turn_json}");
    }
}

#[test]
fn close_and_cancel_of_a_held_turn_work_at_once() {
    let mut e = sim(r#"{"seed":42,"blockSize":4}"#);
    let total = e.stats().total_blocks;
    let (a, b) = (req(&mut e), req(&mut e));
    let ta = e.begin_turn(a, &[5; 9], &turn_opts(r#"{"maxGeneratedTokens":100,"ignoreEos":true}"#)).unwrap();
    let tb = e.begin_turn(b, &[6; 9], &turn_opts(r#"{"maxGeneratedTokens":100,"ignoreEos":true}"#)).unwrap();
    run(&mut e, 8);
    run(&mut e, 8);
    e.hold_turn(a, ta).unwrap();
    e.hold_turn(b, tb).unwrap();
    assert!(e.stats().free_blocks < total);
    e.close_request(a).unwrap();
    assert!(!e.is_turn_held(a).unwrap());
    assert!(e.cancel_turn(b, tb).unwrap());
    let events = run(&mut e, 8);
    let finish = finish_of(&events, b, tb);
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0].finish, FINISH_CANCELLED);
    assert!(!e.is_turn_held(b).unwrap(), "the hold ended with the turn");
    e.close_request(b).unwrap();
    e.check_invariants();
    assert_eq!(e.stats().free_blocks, total, "closing held requests frees their blocks");
}

#[test]
fn a_hold_without_its_running_turn_is_a_no_op() {
    let mut e = sim(r#"{"seed":43}"#);
    let r = req(&mut e);
    assert!(!e.hold_turn(r, TurnId(1)).unwrap(), "no turn yet");
    let t1 = e.begin_turn(r, &[4], &turn_opts(r#"{"maxGeneratedTokens":2}"#)).unwrap();
    assert!(!e.hold_turn(r, TurnId(9)).unwrap(), "another turn id");
    run_all(&mut e, 8);
    assert!(!e.hold_turn(r, t1).unwrap(), "a finished turn");
    let t2 = e.begin_turn(r, &[4], &turn_opts(r#"{"maxGeneratedTokens":2,"ignoreEos":true}"#)).unwrap();
    assert!(!e.is_turn_held(r).unwrap(), "a new turn starts unheld");
    assert_eq!(tokens_of(&run_all(&mut e, 8), r, t2).len(), 2);
    e.close_request(r).unwrap();
    assert!(!e.hold_turn(r, t2).unwrap(), "a closed request");
}

#[test]
fn a_held_prompt_is_not_prefilled() {
    let mut e = sim(r#"{"seed":44}"#);
    let r = req(&mut e);
    let t = e.begin_turn(r, &[4; 20], &turn_opts(r#"{"maxGeneratedTokens":3,"ignoreEos":true}"#)).unwrap();
    e.hold_turn(r, t).unwrap();
    assert!(!e.has_pending_work());
    assert_eq!(e.stats().steps, 0);
    e.release_turn(r, t).unwrap();
    assert_eq!(tokens_of(&run_all(&mut e, 8), r, t).len(), 3);
}

#[test]
fn a_held_turn_never_keeps_others_from_the_pool() {
    // The pool holds one request's KV: a held one is preempted for the other, recomputed after
    // its release, and produces the tokens it would have unheld.
    let engine_json = r#"{"seed":45,"blockSize":4,"numBlocks":6}"#;
    let turn_json = r#"{"maxGeneratedTokens":8,"ignoreEos":true}"#;
    let expected = unheld_tokens(engine_json, &[3; 10], turn_json);
    let mut e = sim(engine_json);
    let held = req(&mut e);
    let th = e.begin_turn(held, &[3; 10], &turn_opts(turn_json)).unwrap();
    let mut events = run(&mut e, 8);
    events.extend(run(&mut e, 8));
    e.hold_turn(held, th).unwrap();
    let other = req(&mut e);
    let to = e.begin_turn(other, &[8; 14], &turn_opts(turn_json)).unwrap();
    events.extend(run_all(&mut e, 8));
    assert_eq!(tokens_of(&events, other, to).len(), 8, "the other request ran past the held one");
    e.release_turn(held, th).unwrap();
    events.extend(run_all(&mut e, 8));
    assert_eq!(tokens_of(&events, held, th), expected);
}

#[test]
fn a_held_row_of_a_static_batch_lets_the_next_batch_form() {
    let mut e = sim(r#"{"seed":46,"batching":"static","maxBatchSize":2}"#);
    let turn_json = r#"{"maxGeneratedTokens":6,"ignoreEos":true}"#;
    let (a, b) = (req(&mut e), req(&mut e));
    let ta = e.begin_turn(a, &[5, 6], &turn_opts(turn_json)).unwrap();
    let tb = e.begin_turn(b, &[7, 8], &turn_opts(turn_json)).unwrap();
    let c = req(&mut e);
    let tc = e.begin_turn(c, &[9, 10], &turn_opts(turn_json)).unwrap();
    let mut events = run(&mut e, 8);
    e.hold_turn(a, ta).unwrap();
    events.extend(run_all(&mut e, 8));
    assert_eq!(tokens_of(&events, b, tb).len(), 6);
    assert_eq!(tokens_of(&events, c, tc).len(), 6, "a waiting request got a batch while a row was held");
    e.release_turn(a, ta).unwrap();
    events.extend(run_all(&mut e, 8));
    assert_eq!(tokens_of(&events, a, ta).len(), 6);
}
