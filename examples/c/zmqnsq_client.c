/*
 * A client for the broker's ZeroMQ protocol in plain C with libzmq, written
 * from docs/PROTOCOL.md alone: it publishes N messages (each acknowledged,
 * matched by its correlation frame), subscribes, takes N messages, checks
 * them and finishes them with one multi-id FIN.
 *
 *   cc -O2 -Wall -o zmqnsq_client zmqnsq_client.c $(pkg-config --cflags --libs libzmq)
 *   ./zmqnsq_client tcp://127.0.0.1:4153 c_topic c_channel 100
 *
 * Exit status 0 when every message came back; it prints "published N" and
 * "received N" lines.
 *
 * CURVE (a broker started with --zmq-curve-secret-key): set ZMQNSQ_CURVE_SERVERKEY
 * to the broker's public key and ZMQNSQ_CURVE_PUBLICKEY / ZMQNSQ_CURVE_SECRETKEY to
 * this client's key pair, all Z85 (40 characters), before it connects.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define MAX_FRAMES 1024
#define HEADER 26 /* 8 timestamp + 2 attempts + 16 id */

typedef struct {
    zmq_msg_t part[MAX_FRAMES];
    int n;
} multipart;

static int recv_multipart(void *sock, multipart *m, int timeout_ms) {
    zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, timeout_ms) <= 0) return -1;
    m->n = 0;
    int more = 1;
    while (more && m->n < MAX_FRAMES) {
        zmq_msg_init(&m->part[m->n]);
        if (zmq_msg_recv(&m->part[m->n], sock, 0) < 0) return -1;
        more = zmq_msg_more(&m->part[m->n]);
        m->n++;
    }
    return m->n;
}

static void close_multipart(multipart *m) {
    for (int i = 0; i < m->n; i++) zmq_msg_close(&m->part[i]);
    m->n = 0;
}

static int frame_is(multipart *m, int i, const char *s) {
    size_t len = strlen(s);
    return i < m->n && zmq_msg_size(&m->part[i]) == len && memcmp(zmq_msg_data(&m->part[i]), s, len) == 0;
}

static void send_frames(void *sock, const char **frames, const size_t *sizes, int n) {
    for (int i = 0; i < n; i++) zmq_send(sock, frames[i], sizes[i], i < n - 1 ? ZMQ_SNDMORE : 0);
}

/* Wait for the OK (or ERROR) answering correlation frame `corr`; answer heartbeats. */
static int wait_reply(void *sock, const char *corr) {
    multipart m;
    for (;;) {
        if (recv_multipart(sock, &m, 10000) < 0) {
            fprintf(stderr, "no reply to %s\n", corr);
            return -1;
        }
        if (frame_is(&m, 0, "HEARTBEAT")) {
            const char *nop[] = {"NOP"};
            size_t s[] = {3};
            send_frames(sock, nop, s, 1);
        } else if (frame_is(&m, 0, corr)) {
            int ok = frame_is(&m, 1, "OK");
            if (!ok && m.n >= 4)
                fprintf(stderr, "error %.*s %.*s\n", (int)zmq_msg_size(&m.part[2]),
                        (char *)zmq_msg_data(&m.part[2]), (int)zmq_msg_size(&m.part[3]),
                        (char *)zmq_msg_data(&m.part[3]));
            close_multipart(&m);
            return ok ? 0 : -1;
        }
        close_multipart(&m);
    }
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s ENDPOINT TOPIC CHANNEL COUNT\n", argv[0]);
        return 2;
    }
    const char *endpoint = argv[1], *topic = argv[2], *channel = argv[3];
    int count = atoi(argv[4]);
    if (count <= 0 || count > MAX_FRAMES - 1) {
        fprintf(stderr, "COUNT must be 1..%d\n", MAX_FRAMES - 1);
        return 2;
    }
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    const char *server_key = getenv("ZMQNSQ_CURVE_SERVERKEY");
    if (server_key != NULL) {
        const char *public_key = getenv("ZMQNSQ_CURVE_PUBLICKEY");
        const char *secret_key = getenv("ZMQNSQ_CURVE_SECRETKEY");
        /* Z85 keys: 40 characters and the terminating NUL */
        if (public_key == NULL || secret_key == NULL
            || zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_key, 41) != 0
            || zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, public_key, 41) != 0
            || zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, secret_key, 41) != 0) {
            fprintf(stderr, "CURVE keys: %s\n", public_key == NULL || secret_key == NULL
                    ? "ZMQNSQ_CURVE_PUBLICKEY and ZMQNSQ_CURVE_SECRETKEY are needed"
                    : zmq_strerror(zmq_errno()));
            return 2;
        }
    }
    if (zmq_connect(sock, endpoint) != 0) {
        fprintf(stderr, "connect %s: %s\n", endpoint, zmq_strerror(zmq_errno()));
        return 1;
    }

    /* PUB with a correlation frame, one at a time: "#<i>" "PUB" topic body */
    char corr[32], body[64];
    for (int i = 0; i < count; i++) {
        snprintf(corr, sizeof corr, "#%d", i);
        snprintf(body, sizeof body, "c-message-%d", i);
        const char *frames[] = {corr, "PUB", topic, body};
        size_t sizes[] = {strlen(corr), 3, strlen(topic), strlen(body)};
        send_frames(sock, frames, sizes, 4);
        if (wait_reply(sock, corr) != 0) return 1;
    }
    printf("published %d\n", count);

    /* SUB, then RDY: "#sub" "SUB" topic channel ; "RDY" "<count>" */
    const char *sub[] = {"#sub", "SUB", topic, channel};
    size_t sub_sizes[] = {4, 3, strlen(topic), strlen(channel)};
    send_frames(sock, sub, sub_sizes, 4);
    if (wait_reply(sock, "#sub") != 0) return 1;
    char rdy[16];
    snprintf(rdy, sizeof rdy, "%d", count);
    const char *rdy_frames[] = {"RDY", rdy};
    size_t rdy_sizes[] = {3, strlen(rdy)};
    send_frames(sock, rdy_frames, rdy_sizes, 2);

    /* MESSAGE m1 m2 ...: each frame is [8B ts][2B attempts][16B id][body] */
    static char ids[MAX_FRAMES][16];
    int seen[MAX_FRAMES] = {0}, received = 0;
    multipart m;
    while (received < count) {
        if (recv_multipart(sock, &m, 10000) < 0) {
            fprintf(stderr, "timed out after %d messages\n", received);
            return 1;
        }
        if (frame_is(&m, 0, "HEARTBEAT")) {
            const char *nop[] = {"NOP"};
            size_t s[] = {3};
            send_frames(sock, nop, s, 1);
        } else if (frame_is(&m, 0, "MESSAGE")) {
            for (int f = 1; f < m.n; f++) {
                size_t size = zmq_msg_size(&m.part[f]);
                const char *data = zmq_msg_data(&m.part[f]);
                int n = -1;
                char text[64] = {0}; /* a frame's body is not NUL-terminated */
                if (size > HEADER && size - HEADER < sizeof text)
                    memcpy(text, data + HEADER, size - HEADER);
                if (size <= HEADER || sscanf(text, "c-message-%d", &n) != 1 ||
                    n < 0 || n >= count) {
                    fprintf(stderr, "unexpected message of %zu bytes\n", size);
                    continue;
                }
                uint16_t attempts = (uint16_t)(((unsigned char)data[8] << 8) | (unsigned char)data[9]);
                if (attempts < 1) fprintf(stderr, "bad attempts %u\n", attempts);
                if (!seen[n]) {
                    seen[n] = 1;
                    memcpy(ids[received++], data + 10, 16);
                }
            }
        }
        close_multipart(&m);
    }
    printf("received %d\n", received);

    /* One FIN for all of them: "FIN" id id ... */
    static const char *fin[MAX_FRAMES];
    static size_t fin_sizes[MAX_FRAMES];
    fin[0] = "FIN";
    fin_sizes[0] = 3;
    for (int i = 0; i < received; i++) {
        fin[i + 1] = ids[i];
        fin_sizes[i + 1] = 16;
    }
    send_frames(sock, fin, fin_sizes, received + 1);
    const char *cls[] = {"#cls", "CLS"};
    size_t cls_sizes[] = {4, 3};
    send_frames(sock, cls, cls_sizes, 2);
    if (wait_reply(sock, "#cls") != 0) return 1;
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return 0;
}
