// The Java code context's driver: JShell, in this JVM, one cell at a time.
//
// Cells and answers travel on descriptor 3, a socket the host handed over and
// no other process of the sandbox holds (a socket cannot be reopened through
// /proc). A cell is "<length>\n<UTF-8 source>"; its answer is one line of JSON
// ({"count", "result", "error"}), written after the cell's output is flushed.
// The JShell runs with the "local" execution engine: snippets run in this JVM,
// so their System.out is this process's standard output, and no agent JVM and
// no debugger socket are started.
//
// Errors keep the names the upstream Java kernel (IJava) gives: a snippet that
// throws is an EvalException, one that does not compile a CompilationException.
//
// Kept (a context of a kept sandbox, issue 38; JDK 16 or later, for unix
// sockets): "--kept PATH" starts a second JVM, "--kept-driver PATH", that
// outlives the command (and so the server) and listens on PATH, a socket of
// the sandbox's private /tmp, serving one host at a time; "--relay PATH" is
// each server's relay to it. The protocol is driver.js's kept one: frames (a
// kind byte, a 4-byte big-endian length, the bytes) of the output ("o", "e")
// and of the channel ("c": "hello PID", then the answers) from the driver, the
// cells as they are to it. The relay interrupts first a cell the driver may
// still run for the last server ("--relay-fresh PATH", a context's first
// relay, has none to interrupt).

import java.io.BufferedInputStream;
import java.io.ByteArrayOutputStream;
import java.io.DataInputStream;
import java.io.FileDescriptor;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.io.InputStream;
import java.io.PrintStream;
import java.lang.reflect.Field;
import java.net.ProtocolFamily;
import java.net.SocketAddress;
import java.net.StandardProtocolFamily;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.attribute.PosixFilePermissions;
import java.util.ArrayList;
import java.util.List;
import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;

public final class IsolateDriver {
    /** A cell is running: SIGINT stops it. */
    private static volatile boolean running;
    /** SIGINT stopped the running cell. */
    private static volatile boolean stopped;
    /** Cells run so far, over every host. */
    private static int count;
    /** A kept driver's host of the moment (null: none, its output goes nowhere). */
    private static SocketChannel session;

    private IsolateDriver() {}

    public static void main(String[] args) throws Exception {
        String mode = args.length == 2 ? args[0] : "";
        if (mode.equals("--relay") || mode.equals("--relay-fresh")) {
            relay(args[1], mode.equals("--relay"));
            return;
        }
        if (mode.equals("--kept")) {
            launch(args[1]);
            return;
        }
        boolean kept = mode.equals("--kept-driver");
        PrintStream out = kept ? new PrintStream(new Framed('o'), true, StandardCharsets.UTF_8) : System.out;
        PrintStream err = kept ? new PrintStream(new Framed('e'), true, StandardCharsets.UTF_8) : System.err;
        JShell shell = JShell.builder().executionEngine("local").out(out).err(err).build();
        shell.eval("int isolateWarmUp = 0;");  // the first eval loads the compiler: before the hello, not in a cell
        shell.drop(shell.snippets().filter(s -> s.source().contains("isolateWarmUp")).findFirst().orElseThrow());
        // SIGINT stops the running cell (JShell.stop), and nothing else: between cells it is ignored.
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), signal -> {
            if (running) {
                stopped = true;
                shell.stop();
            }
        });
        if (kept) {
            keep(args[1], shell, out, err);
            return;
        }
        FileDescriptor descriptor = descriptor3();
        DataInputStream cells = new DataInputStream(new BufferedInputStream(new FileInputStream(descriptor)));
        OutputStream answers = new FileOutputStream(descriptor);
        answers.write("hello\n".getBytes(StandardCharsets.US_ASCII));
        answers.flush();
        serve(shell, cells, answers);
        shell.close();
        System.exit(0);
    }

    private static FileDescriptor descriptor3() throws ReflectiveOperationException {
        FileDescriptor descriptor = new FileDescriptor();
        Field number = FileDescriptor.class.getDeclaredField("fd");  // needs --add-opens java.base/java.io
        number.setAccessible(true);
        number.setInt(descriptor, 3);
        return descriptor;
    }

    /** Heap held back for the cell after one that filled it: compiling even "big = null" needs some. */
    private static final int RESERVE = (int) Math.min(16L << 20, Runtime.getRuntime().maxMemory() / 16);
    private static byte[] reserve = new byte[RESERVE];

    /** After a cell that ran out of memory, the reserve is let go (its variables still hold the heap, and the
     *  next cell must compile to free them); after one that did not, it is taken again if it can be. */
    private static void keepHeadroom(String[] outcome) {
        if (outcome[2] != null && outcome[2].startsWith("java.lang.OutOfMemoryError")) {
            reserve = null;
        } else if (reserve == null) {
            try {
                reserve = new byte[RESERVE];
            } catch (OutOfMemoryError stillFull) {
                // the next cell runs without one
            }
        }
    }

    /** Runs the cells of one host until its end. */
    private static void serve(JShell shell, DataInputStream cells, OutputStream answers) throws IOException {
        while (true) {
            String header = readLine(cells);
            if (header == null) {
                break;
            }
            byte[] code = new byte[Integer.parseInt(header.trim())];
            cells.readFully(code);
            count++;
            stopped = false;
            running = true;
            String[] outcome;
            try {
                outcome = run(shell, new String(code, StandardCharsets.UTF_8));
            } catch (OutOfMemoryError full) {
                // JShell's own work (compiling the cell, wrapping what it threw) ran out of heap: an answer,
                // not a dead driver. The reserve goes first, so that the answer itself can be made.
                reserve = null;
                outcome = new String[] {null, "EvalException", "java.lang.OutOfMemoryError: " + full.getMessage()
                                        + " (the interpreter's own, running the cell)", ""};
            } catch (RuntimeException | StackOverflowError broken) {
                outcome = new String[] {null, broken.getClass().getSimpleName(), String.valueOf(broken), ""};
            }
            running = false;
            keepHeadroom(outcome);
            if (stopped && outcome[1] == null) {  // JShell reports a stopped snippet as no event at all
                outcome = new String[] {null, "InterruptedException", "the cell was interrupted", ""};
            }
            System.out.flush();
            System.err.flush();
            String answer = "{\"count\": " + count + ", \"result\": " + json(outcome[0]) + ", \"error\": "
                + (outcome[1] == null ? "null" : "{\"ename\": " + json(outcome[1]) + ", \"evalue\": "
                   + json(outcome[2]) + ", \"traceback\": [" + json(outcome[3]) + "]}") + "}\n";
            answers.write(answer.getBytes(StandardCharsets.UTF_8));
            answers.flush();
        }
    }

    /** A unix socket's address, and a channel of that family (JDK 16 or later; found at run time, so that
     *  the driver still compiles on JDK 11 for the contexts that end with their server). */
    private static SocketAddress unixAddress(String place) throws ReflectiveOperationException {
        return (SocketAddress) Class.forName("java.net.UnixDomainSocketAddress").getMethod("of", String.class)
            .invoke(null, place);
    }

    private static Object unixChannel(Class<?> kind) throws ReflectiveOperationException {
        return kind.getMethod("open", ProtocolFamily.class).invoke(null, StandardProtocolFamily.valueOf("UNIX"));
    }

    private static byte[] frame(char kind, byte[] data, int offset, int length) {
        ByteBuffer framed = ByteBuffer.allocate(5 + length);
        framed.put((byte) kind).putInt(length).put(data, offset, length);
        return framed.array();
    }

    private static void writeAll(SocketChannel channel, byte[] data) throws IOException {
        ByteBuffer buffer = ByteBuffer.wrap(data);
        while (buffer.hasRemaining()) {
            channel.write(buffer);
        }
    }

    /** A kept driver's output or answers: frames to its host of the moment; with none, or one gone, nowhere. */
    private static final class Framed extends OutputStream {
        private final char kind;

        Framed(char kind) {
            this.kind = kind;
        }

        @Override
        public void write(int b) {
            write(new byte[] {(byte) b}, 0, 1);
        }

        @Override
        public void write(byte[] data, int offset, int length) {
            synchronized (Framed.class) {
                if (session == null || length == 0) {
                    return;
                }
                try {
                    writeAll(session, frame(kind, data, offset, length));
                } catch (IOException gone) {
                    // its host went away: the next reads its end
                }
            }
        }
    }

    /** What a channel gives, as a stream (no lock shared with its writes, as Channels' streams have). */
    private static InputStream reading(SocketChannel channel) {
        return new InputStream() {
            @Override
            public int read() throws IOException {
                byte[] one = new byte[1];
                return read(one, 0, 1) < 0 ? -1 : one[0] & 0xff;
            }

            @Override
            public int read(byte[] data, int offset, int length) throws IOException {
                return length == 0 ? 0 : channel.read(ByteBuffer.wrap(data, offset, length));
            }
        };
    }

    private static void keep(String place, JShell shell, PrintStream out, PrintStream err) throws Exception {
        ServerSocketChannel listener = (ServerSocketChannel) unixChannel(ServerSocketChannel.class);
        Path path = Path.of(place);
        Files.deleteIfExists(path);
        listener.bind(unixAddress(place));
        Files.setPosixFilePermissions(path, PosixFilePermissions.fromString("rw-------"));
        Files.writeString(Path.of(place.replaceAll("\\.sock$", ".pid")), ProcessHandle.current().pid() + "\n");
        System.setOut(out);
        System.setErr(err);
        OutputStream answers = new Framed('c');
        while (true) {
            SocketChannel host = listener.accept();
            synchronized (Framed.class) {
                session = host;
            }
            try {
                answers.write(("hello " + ProcessHandle.current().pid() + "\n").getBytes(StandardCharsets.US_ASCII));
                serve(shell, new DataInputStream(new BufferedInputStream(reading(host))), answers);
            } catch (IOException | RuntimeException gone) {
                // its host went away, or sent what is not a cell: the next one
            }
            synchronized (Framed.class) {
                session = null;
            }
            host.close();
        }
    }

    /** Sends SIGINT to a process of the sandbox (Java has no call for it: the shell's kill builtin). */
    private static void interrupt(long pid) {
        if (pid <= 1) {
            return;
        }
        try {
            new ProcessBuilder("sh", "-c", "kill -INT \"$0\" 2>/dev/null", Long.toString(pid))
                .redirectOutput(ProcessBuilder.Redirect.DISCARD).redirectError(ProcessBuilder.Redirect.DISCARD)
                .start().waitFor();
        } catch (IOException | InterruptedException ignored) {
            // gone, or no sh: nothing to interrupt then
        }
    }

    private static volatile long driver;
    /** The relay has had the driver's hello: the driver was between cells, or is now. */
    private static volatile boolean helloSeen;
    /** How long a relay waits for the hello before it takes the driver for busy with an earlier cell. */
    private static final long HELLO_WAIT_MS = 300;

    /** The relay (see the top of this file): the host's channel and pipes on one side, the driver on the other. */
    private static void relay(String place, boolean interruptFirst) throws Exception {
        try {
            driver = Long.parseLong(Files.readString(Path.of(place.replaceAll("\\.sock$", ".pid"))).trim());
        } catch (IOException | NumberFormatException unknown) {
            driver = 0;
        }
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), signal -> interrupt(driver));  // the host's, passed on
        SocketChannel conn = (SocketChannel) unixChannel(SocketChannel.class);
        try {
            conn.connect(unixAddress(place));
        } catch (IOException gone) {
            System.err.println("isolate: the context's interpreter is gone (" + gone.getMessage() + ")");
            System.exit(1);
        }
        // A driver between cells says hello at once; one that does not is still running a cell of the last
        // server, which is then stopped. Not sent otherwise: the JVM runs a SIGINT's handler on a thread of its
        // own, and one handled late, once this host's first cell runs, would stop that cell instead. A
        // context's first relay ("--relay-fresh") has no earlier cell to stop.
        if (interruptFirst) {
            Thread late = new Thread(() -> {
                try {
                    Thread.sleep(HELLO_WAIT_MS);
                } catch (InterruptedException ignored) {
                    return;
                }
                if (!helloSeen) {
                    interrupt(driver);
                }
            });
            late.setDaemon(true);
            late.start();
        }
        FileDescriptor descriptor = descriptor3();
        FileOutputStream host = new FileOutputStream(descriptor);
        Thread cells = new Thread(() -> {
            byte[] buffer = new byte[65536];
            try (FileInputStream from = new FileInputStream(descriptor)) {
                for (int n = from.read(buffer); n >= 0; n = from.read(buffer)) {
                    writeAll(conn, java.util.Arrays.copyOf(buffer, n));
                }
            } catch (IOException gone) {
                // either side gone
            }
            System.exit(0);
        });
        cells.setDaemon(true);
        cells.start();
        DataInputStream frames = new DataInputStream(new BufferedInputStream(reading(conn)));
        FileOutputStream stdout = new FileOutputStream(FileDescriptor.out);
        FileOutputStream stderr = new FileOutputStream(FileDescriptor.err);
        boolean hello = true;
        try {
            while (true) {
                int kind = frames.read();
                if (kind < 0) {
                    break;
                }
                byte[] body = new byte[frames.readInt()];
                frames.readFully(body);
                if (kind == 'o' || kind == 'e') {
                    (kind == 'o' ? stdout : stderr).write(body);  // before the answer that follows it
                } else if (kind == 'c') {
                    if (hello) {
                        hello = false;
                        helloSeen = true;
                        String said = new String(body, StandardCharsets.US_ASCII);
                        driver = said.matches("hello [0-9]{1,9}\n") ? Long.parseLong(said.substring(6).trim()) : 0;
                    }
                    host.write(body);
                }
            }
        } catch (IOException gone) {
            // the driver went away
        }
        System.exit(0);
    }

    /** Starts the kept driver, and ends once it listens (its hello on PATH names it) or it ended. */
    private static void launch(String place) throws Exception {
        ProcessHandle.Info info = ProcessHandle.current().info();
        List<String> command = new ArrayList<>();
        command.add(info.command().orElse("java"));
        for (String argument : info.arguments().orElse(new String[0])) {
            command.add(argument.equals("--kept") ? "--kept-driver" : argument);
        }
        try {
            unixAddress(place);
        } catch (ClassNotFoundException older) {
            System.err.println("isolate: a kept Java context needs JDK 16 or later (unix sockets)");
            System.exit(3);  // the server then makes one that ends with it
        }
        Process keeper = new ProcessBuilder(command).redirectInput(ProcessBuilder.Redirect.INHERIT)
            .redirectOutput(ProcessBuilder.Redirect.DISCARD).start();
        ByteArrayOutputStream said = new ByteArrayOutputStream();
        Thread reader = new Thread(() -> {
            try (InputStream from = keeper.getErrorStream()) {
                from.transferTo(said);
            } catch (IOException ignored) {
                // it ended
            }
        });
        reader.setDaemon(true);
        reader.start();
        byte[] hello = ("hello " + keeper.pid() + "\n").getBytes(StandardCharsets.US_ASCII);
        long deadline = System.nanoTime() + 50_000_000_000L;
        while (System.nanoTime() < deadline) {
            if (!keeper.isAlive()) {
                reader.join(2000);
                String[] lines = said.toString(StandardCharsets.UTF_8).strip().split("\n");
                System.err.println("isolate: the kept driver ended before it listened: " + lines[lines.length - 1]);
                System.exit(1);
            }
            try (SocketChannel probe = (SocketChannel) unixChannel(SocketChannel.class)) {
                probe.connect(unixAddress(place));
                DataInputStream frames = new DataInputStream(reading(probe));
                frames.readByte();
                byte[] body = new byte[Math.min(64, frames.readInt())];
                frames.readFully(body);
                if (java.util.Arrays.equals(body, hello)) {
                    System.exit(0);
                }
            } catch (IOException notYet) {
                // not listening yet
            }
            Thread.sleep(100);
        }
        System.err.println("isolate: the kept driver did not listen in 50 s");
        System.exit(1);
    }

    /** Runs a cell snippet by snippet: {result, ename, evalue, traceback}, the error's fields null when none. */
    private static String[] run(JShell shell, String code) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String result = null;
        String rest = code;
        while (!rest.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(rest);
            String snippet = info.completeness().isComplete() ? info.source() : rest;
            rest = info.completeness().isComplete() ? info.remaining() : "";
            for (SnippetEvent event : shell.eval(snippet)) {
                if (event.causeSnippet() != null) {
                    continue;  // a dependent snippet's update, not this one's outcome
                }
                if (event.status() == Snippet.Status.REJECTED) {
                    StringBuilder messages = new StringBuilder();
                    for (Diag diag : (Iterable<Diag>) shell.diagnostics(event.snippet())::iterator) {
                        if (diag.isError()) {
                            messages.append(messages.length() == 0 ? "" : "\n").append(diag.getMessage(null));
                        }
                    }
                    return new String[] {null, "CompilationException", messages.toString(), snippet.strip()};
                }
                JShellException thrown = event.exception();
                if (thrown != null) {
                    String name = thrown instanceof EvalException
                        ? ((EvalException) thrown).getExceptionClassName() : thrown.getClass().getName();
                    StringWriter trace = new StringWriter();
                    thrown.printStackTrace(new PrintWriter(trace));
                    String message = thrown.getMessage();
                    return new String[] {null, thrown.getClass().getSimpleName(),
                                         name + (message == null ? "" : ": " + message), trace.toString()};
                }
                Snippet.SubKind kind = event.snippet().subKind();
                boolean expression = event.snippet().kind() == Snippet.Kind.EXPRESSION
                    || kind == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND;
                result = expression ? event.value() : null;  // the value of a cell's last expression, as in a notebook
            }
        }
        return new String[] {result, null, null, null};
    }

    private static String readLine(DataInputStream in) throws IOException {
        ByteArrayOutputStream line = new ByteArrayOutputStream();
        for (int b = in.read(); b != '\n'; b = in.read()) {
            if (b < 0) {
                return null;
            }
            if (line.size() > 20) {
                throw new IOException("a cell's header is longer than a length");
            }
            line.write(b);
        }
        return line.toString(StandardCharsets.US_ASCII);
    }

    private static String json(String value) {
        if (value == null) {
            return "null";
        }
        StringBuilder out = new StringBuilder("\"");
        for (int i = 0; i < value.length(); i++) {
            char c = value.charAt(i);
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }
}
