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
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
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

    private IsolateDriver() {}

    public static void main(String[] args) throws Exception {
        FileDescriptor descriptor = new FileDescriptor();
        Field number = FileDescriptor.class.getDeclaredField("fd");  // needs --add-opens java.base/java.io
        number.setAccessible(true);
        number.setInt(descriptor, 3);
        DataInputStream cells = new DataInputStream(new BufferedInputStream(new FileInputStream(descriptor)));
        OutputStream answers = new FileOutputStream(descriptor);

        JShell shell = JShell.builder().executionEngine("local").out(System.out).err(System.err).build();
        shell.eval("int isolateWarmUp = 0;");  // the first eval loads the compiler: before the hello, not in a cell
        shell.drop(shell.snippets().filter(s -> s.source().contains("isolateWarmUp")).findFirst().orElseThrow());
        // SIGINT stops the running cell (JShell.stop), and nothing else: between cells it is ignored.
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), signal -> {
            if (running) {
                stopped = true;
                shell.stop();
            }
        });
        answers.write("hello\n".getBytes(StandardCharsets.US_ASCII));
        answers.flush();

        int count = 0;
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
            String[] outcome = run(shell, new String(code, StandardCharsets.UTF_8));
            running = false;
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
        shell.close();
        System.exit(0);
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
