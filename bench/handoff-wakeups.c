// What a cross-thread hand-off costs on this machine, by the kernel mechanism that wakes the
// other thread. The shape of a driven ortex step at concurrency 1: a "step" thread works (the
// session run), wakes the "event-loop" thread and sleeps; the event-loop thread works (routing
// the events), wakes the step thread and sleeps; a third thread spins throughout, as ONNX
// Runtime's second intra-op thread does between runs. See docs/performance.md ("What bounds it").
//
//   mechanism 0: eventfd watched by epoll (libuv's async handle, under Node-API's threadsafe
//                functions) one way, a futex (Rust's channel) the other
//   mechanism 1: a pipe each way (pipe wake-ups are "sync": the woken thread may stay on the
//                waker's core, which is about to sleep)
//
//   cc -O2 -o /tmp/handoff-wakeups bench/handoff-wakeups.c -lpthread
//   /tmp/handoff-wakeups MECHANISM ROUND_TRIPS STEP_WORK_US LOOP_WORK_US
//   e.g. for m in 0 1 0 1; do /tmp/handoff-wakeups $m 300 2000 200; done
//
// Prints the time per round trip beyond the two threads' work, and the mean latency of each
// wake-up (from the waker's signal to the woken thread running).
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int mechanism;
static int loop_eventfd, loop_pipe[2], step_pipe[2], loop_epoll;
static atomic_int step_futex_word;
static atomic_int stop_spinning;
static int round_trips;
static double step_work_us, loop_work_us;
static double loop_signalled_at_us, step_signalled_at_us;
static double loop_wake_sum_us, step_wake_sum_us;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void work_for(double us) {
    double end_us = now_us() + us;
    while (now_us() < end_us) {
    }
}

static void *spin(void *unused) {
    (void)unused;
    while (!atomic_load(&stop_spinning)) __builtin_ia32_pause();
    return NULL;
}

static void wake_loop(void) {
    if (mechanism == 0) {
        uint64_t one = 1;
        if (write(loop_eventfd, &one, sizeof one) != sizeof one) abort();
    } else {
        char byte = 1;
        if (write(loop_pipe[1], &byte, 1) != 1) abort();
    }
}

static void wait_loop(void) {
    struct epoll_event event;
    while (epoll_wait(loop_epoll, &event, 1, -1) != 1) {
    }
    if (mechanism == 0) {
        uint64_t count;
        if (read(loop_eventfd, &count, sizeof count) != sizeof count) abort();
    } else {
        char byte;
        if (read(loop_pipe[0], &byte, 1) != 1) abort();
    }
}

static void wake_step(void) {
    if (mechanism == 0) {
        atomic_store(&step_futex_word, 1);
        syscall(SYS_futex, &step_futex_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    } else {
        char byte = 1;
        if (write(step_pipe[1], &byte, 1) != 1) abort();
    }
}

static void wait_step(void) {
    if (mechanism == 0) {
        while (atomic_exchange(&step_futex_word, 0) == 0)
            syscall(SYS_futex, &step_futex_word, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
    } else {
        char byte;
        if (read(step_pipe[0], &byte, 1) != 1) abort();
    }
}

static void *step_thread(void *unused) {
    (void)unused;
    for (int i = 0; i < round_trips; i++) {
        work_for(step_work_us);
        loop_signalled_at_us = now_us();
        wake_loop();
        wait_step();
        step_wake_sum_us += now_us() - step_signalled_at_us;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MECHANISM(0|1) ROUND_TRIPS STEP_WORK_US LOOP_WORK_US\n", argv[0]);
        return 2;
    }
    mechanism = atoi(argv[1]);
    round_trips = atoi(argv[2]);
    step_work_us = atof(argv[3]);
    loop_work_us = atof(argv[4]);
    if (round_trips < 1 || (mechanism != 0 && mechanism != 1)) return 2;

    loop_eventfd = eventfd(0, 0);
    if (loop_eventfd < 0 || pipe(loop_pipe) != 0 || pipe(step_pipe) != 0) return 1;
    loop_epoll = epoll_create1(0);
    struct epoll_event watched = {.events = EPOLLIN};
    watched.data.fd = mechanism == 0 ? loop_eventfd : loop_pipe[0];
    if (epoll_ctl(loop_epoll, EPOLL_CTL_ADD, watched.data.fd, &watched) != 0) return 1;

    pthread_t spinner, stepper;
    pthread_create(&spinner, NULL, spin, NULL);
    double started_us = now_us();
    pthread_create(&stepper, NULL, step_thread, NULL);
    for (int i = 0; i < round_trips; i++) {
        wait_loop();
        loop_wake_sum_us += now_us() - loop_signalled_at_us;
        work_for(loop_work_us);
        step_signalled_at_us = now_us();
        wake_step();
    }
    pthread_join(stepper, NULL);
    double per_round_trip_us = (now_us() - started_us) / round_trips;
    atomic_store(&stop_spinning, 1);
    pthread_join(spinner, NULL);
    printf("mechanism %d (%s): %.1f us per round trip, %.1f us beyond the work "
           "(wake the loop %.1f us, wake the step thread %.1f us)\n",
           mechanism, mechanism == 0 ? "eventfd + futex" : "pipes", per_round_trip_us,
           per_round_trip_us - step_work_us - loop_work_us, loop_wake_sum_us / round_trips,
           step_wake_sum_us / round_trips);
    return 0;
}
