/* mc-enter: start one command inside a sandbox's namespaces, as a container runtime's `exec` does, in one process.
 *
 * The host runs it (as root, or as the user that owns the sandbox's user namespace) for every command of an
 * episode: it joins the sandbox's cgroup, sets the command's rlimits, joins the namespaces of the episode's init
 * (user first, then mount, network, ipc, uts, cgroup and pid), forks into the pid namespace, and in the child starts
 * a new session, takes the command's uid and gid with no supplementary groups, drops every capability (bounding set
 * included), sets no_new_privs, installs the seccomp filter and execs. The parent waits and exits with the child's
 * status (128 + the signal for a child killed by one), so the host's waitpid sees the command's own status.
 *
 *   mc-enter [--cgroup FILE]... [--rlimit RES=SOFT:HARD]... [--ns PID] [--ns-file TYPE=PATH]... [--expect PID:START]
 *            [--uid UID --gid GID] [--keep-caps] [--seccomp FD] [--chdir DIR] -- PROGRAM [ARG]...
 *
 * --ns PID joins every namespace of PID; --ns-file joins one namespace held by a file (TYPE: user, mnt, net, ipc,
 * uts, cgroup, pid). --expect PID:START refuses (status 125) unless, once the namespaces are open, PID is still the
 * process that started at START (clock ticks after boot): the process that holds them may have died and its pid been
 * reused by another. --keep-caps keeps the capabilities of the uid it runs as (for a launcher that
 * builds its own sandbox, such as bubblewrap). Errors are one line on stderr and status 125. The reference for what
 * it does is the argv chain it replaces (rl/sandbox/launcher.py): sh (cgroup) + prlimit + nsenter + setpriv.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <grp.h>

#define FAIL 125

static void die(const char *what, const char *arg) {
    int e = errno;
    fprintf(stderr, "mc-enter: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(e));
    _exit(FAIL);
}

static void usage(const char *why) {
    fprintf(stderr, "mc-enter: %s\n", why);
    _exit(FAIL);
}

static const struct { const char *name; int resource; } RLIMITS[] = {
    {"cpu", RLIMIT_CPU}, {"as", RLIMIT_AS}, {"nproc", RLIMIT_NPROC}, {"fsize", RLIMIT_FSIZE},
    {"nofile", RLIMIT_NOFILE}, {"core", RLIMIT_CORE}, {"stack", RLIMIT_STACK},
};

static const struct { const char *name; int type; } NAMESPACES[] = {
    /* user first: joining it gives the capabilities that joining the others needs */
    {"user", CLONE_NEWUSER}, {"mnt", CLONE_NEWNS}, {"net", CLONE_NEWNET}, {"ipc", CLONE_NEWIPC},
    {"uts", CLONE_NEWUTS}, {"cgroup", CLONE_NEWCGROUP}, {"pid", CLONE_NEWPID},
};
#define N_NS (sizeof(NAMESPACES) / sizeof(NAMESPACES[0]))

static void set_rlimit(const char *spec) {
    const char *eq = strchr(spec, '=');
    if (!eq) usage("--rlimit takes RES=SOFT:HARD");
    for (size_t i = 0; i < sizeof(RLIMITS) / sizeof(RLIMITS[0]); i++) {
        if (strlen(RLIMITS[i].name) == (size_t)(eq - spec) && !strncmp(spec, RLIMITS[i].name, eq - spec)) {
            char *end;
            struct rlimit r;
            r.rlim_cur = strtoull(eq + 1, &end, 10);
            r.rlim_max = *end == ':' ? strtoull(end + 1, &end, 10) : r.rlim_cur;
            if (*end) usage("--rlimit takes RES=SOFT:HARD (numbers)");
            if (setrlimit(RLIMITS[i].resource, &r)) die("setrlimit", spec);
            return;
        }
    }
    usage("--rlimit: unknown resource");
}

static void join_cgroup(const char *procs) {
    int fd = open(procs, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "0", 1) != 1) die("cannot join the sandbox's cgroup", procs);
    close(fd);
}

static void drop_bounding_set(void) {
    for (int cap = 0; cap <= CAP_LAST_CAP; cap++) {
        if (!prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) || errno == EINVAL) continue;
        if (errno == EPERM) break;  /* no CAP_SETPCAP: a process without capabilities, whose no_new_privs keeps it so */
        die("cannot drop the bounding set", NULL);
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

static void drop_capabilities(void) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof(data));
    if (syscall(SYS_capset, &hdr, data)) die("cannot drop capabilities", NULL);
}

static void install_seccomp(int fd) {
    static char prog[65536];
    ssize_t n, total = 0;
    while ((n = read(fd, prog + total, sizeof(prog) - total)) > 0) total += n;
    if (n < 0 || total == 0 || total % sizeof(struct sock_filter)) usage("--seccomp: not a filter program");
    close(fd);
    struct sock_fprog fprog = {(unsigned short)(total / sizeof(struct sock_filter)), (struct sock_filter *)prog};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog)) die("cannot install the seccomp filter", NULL);
}

/* Whether "PID:START" names a process that runs now (field 22 of /proc/PID/stat is its start time). */
static int still_running(const char *spec) {
    char path[64], buf[1024];
    long pid = atol(spec);
    const char *colon = strchr(spec, ':');
    if (!colon || pid <= 0) usage("--expect takes PID:START");
    snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    /* after ") " come fields 3, 4, ...: the start time is field 22, the 20th of them */
    for (int field = 3; field <= 22 && p; field++) p = strchr(p + 1, ' ');
    return p && strtoull(p + 1, NULL, 10) == strtoull(colon + 1, NULL, 10);
}

int main(int argc, char **argv) {
    int ns_fd[N_NS];
    for (size_t i = 0; i < N_NS; i++) ns_fd[i] = -1;
    long uid = -1, gid = -1;
    int seccomp_fd = -1, keep_caps = 0;
    const char *chdir_to = NULL;
    const char *expect = NULL;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--")) { i++; break; }
        if (!strcmp(a, "--keep-caps")) { keep_caps = 1; continue; }
        if (!v) usage("an option lacks its value");
        i++;
        if (!strcmp(a, "--cgroup")) join_cgroup(v);
        else if (!strcmp(a, "--rlimit")) set_rlimit(v);
        else if (!strcmp(a, "--uid")) uid = atol(v);
        else if (!strcmp(a, "--gid")) gid = atol(v);
        else if (!strcmp(a, "--seccomp")) seccomp_fd = atoi(v);
        else if (!strcmp(a, "--chdir")) chdir_to = v;
        else if (!strcmp(a, "--expect")) expect = v;
        else if (!strcmp(a, "--ns")) {
            char path[64];
            for (size_t k = 0; k < N_NS; k++) {
                snprintf(path, sizeof(path), "/proc/%s/ns/%s", v, NAMESPACES[k].name);
                if (ns_fd[k] >= 0) close(ns_fd[k]);
                ns_fd[k] = open(path, O_RDONLY | O_CLOEXEC);
                if (ns_fd[k] < 0) die("the sandbox's episode is gone", path);
            }
        } else if (!strcmp(a, "--ns-file")) {
            const char *eq = strchr(v, '=');
            size_t k = 0;
            for (; eq && k < N_NS; k++)
                if (strlen(NAMESPACES[k].name) == (size_t)(eq - v) && !strncmp(v, NAMESPACES[k].name, eq - v)) break;
            if (!eq || k == N_NS) usage("--ns-file takes TYPE=PATH");
            if (ns_fd[k] >= 0) close(ns_fd[k]);
            ns_fd[k] = open(eq + 1, O_RDONLY | O_CLOEXEC);
            if (ns_fd[k] < 0) die("cannot open a namespace", eq + 1);
        } else usage("unknown option");
    }
    if (i >= argc) usage("no command");
    if (expect && !still_running(expect)) {
        errno = ESRCH;
        die("the sandbox's namespaces are gone (the process that held them ended)", NULL);
    }
    for (size_t k = 0; k < N_NS; k++) {
        if (ns_fd[k] < 0) continue;
        if (setns(ns_fd[k], NAMESPACES[k].type)) die("cannot join the sandbox's namespace", NAMESPACES[k].name);
        close(ns_fd[k]);
    }
    if (chdir_to && chdir(chdir_to)) die("cannot change to the working directory", chdir_to);
    pid_t child = fork();
    if (child < 0) die("fork", NULL);
    if (child == 0) {
        if (setsid() < 0) die("setsid", NULL);
        if (gid >= 0) {
            if (setgroups(0, NULL) && errno != EPERM) die("setgroups", NULL);
            if (setresgid(gid, gid, gid)) die("setresgid", NULL);
        }
        if (!keep_caps) drop_bounding_set();  /* while CAP_SETPCAP is still held */
        if (uid >= 0 && setresuid(uid, uid, uid)) die("setresuid", NULL);
        if (!keep_caps) drop_capabilities();
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) die("no_new_privs", NULL);
        if (seccomp_fd >= 0) install_seccomp(seccomp_fd);
        execvp(argv[i], argv + i);
        fprintf(stderr, "mc-enter: cannot run %s: %s\n", argv[i], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }
    if (seccomp_fd >= 0) close(seccomp_fd);
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) die("waitpid", NULL);
    if (WIFSIGNALED(status)) _exit(128 + WTERMSIG(status));
    _exit(WEXITSTATUS(status));
}
