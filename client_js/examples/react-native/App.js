// A chat screen on the tokenwire JS client: replies stream token by token, survive the app going to the
// background, a network switch and the app being killed, and Stop works after any reconnect. The logic
// lives in chat-controller.js; this file only renders it.
import AsyncStorage from "@react-native-async-storage/async-storage";
import NetInfo from "@react-native-community/netinfo";
import * as tokenwire from "@tokenwire/client";
import Constants from "expo-constants";
import { useEffect, useRef, useState } from "react";
import { AppState, Button, FlatList, KeyboardAvoidingView, Platform, Text, TextInput, View } from "react-native";

import { createChatController } from "./chat-controller";

// The server's WebSocket endpoint: app.json's extra.tokenwireUrl (see README.md).
const URL = Constants.expoConfig?.extra?.tokenwireUrl ?? "ws://10.0.2.2:8765/v1/ws";

/** What a finished reply's bubble says after its text ("" when it simply ended). */
function endNote(item) {
  if (item.finish === "cancelled") {
    return item.cancelReason === "detach_timeout" ? " [interrupted: the app was away too long]" : " [stopped]";
  }
  return item.finish === "error" ? ` [${item.error}]` : "";
}

export default function App() {
  const [view, setView] = useState({ state: "connecting", messages: [], streaming: null });
  const [draft, setDraft] = useState("");
  const chat = useRef(null);

  useEffect(() => {
    const c = createChatController({ tokenwire, url: URL, AppState, NetInfo, AsyncStorage, onChange: setView });
    chat.current = c;
    c.start();
    return () => c.dispose();
  }, []);

  const send = () => {
    const text = draft.trim();
    if (!text || view.streaming) return;
    setDraft("");
    chat.current.send(text);
  };

  return (
    <KeyboardAvoidingView style={{ flex: 1, paddingTop: 48 }} behavior={Platform.OS === "ios" ? "padding" : undefined}>
      <Text style={{ textAlign: "center", color: view.state === "open" ? "green" : "gray" }}>{view.state}</Text>
      <FlatList
        style={{ flex: 1, padding: 12 }}
        data={view.messages}
        keyExtractor={(m, i) => m.id ?? String(i)}
        renderItem={({ item }) => (
          <Text style={{ marginVertical: 6, alignSelf: item.role === "user" ? "flex-end" : "flex-start" }}>
            {item.text}
            {endNote(item)}
          </Text>
        )}
      />
      <View style={{ flexDirection: "row", padding: 8 }}>
        <TextInput style={{ flex: 1, borderWidth: 1, padding: 8 }} value={draft} onChangeText={setDraft} onSubmitEditing={send} placeholder="Message" />
        {view.streaming ? <Button title="Stop" onPress={() => chat.current.stop()} /> : <Button title="Send" onPress={send} />}
      </View>
    </KeyboardAvoidingView>
  );
}
